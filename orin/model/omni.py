"""Qwen3-Omni's module tree, orin-omni's own: every parameter under transformers 5.23's name and shape
(`thinker.model.language_model.layers.0.mlp.experts.gate_up_proj`, `talker.code_predictor.lm_head.0.weight`,
`code2wav.decoder.1.block.0.alpha`, ...), so the loader reads a checkpoint into it by name, GPTQ's module paths
name its modules, and the components (orin.components) are prefixes of it. Built from config.json alone
(orin.model.config), importing only torch: the device side needs no transformers.

The tree holds weights and what the stages call: the encoders and code2wav compute (their own modules), the
decoders are run by orin.runtime.decode over these modules' tensors. Build it under `torch.device("meta")` to size a
model without a byte of weights (orin.memory.plan), or with orin.memory.loader's meta parameters and real buffers to load it.
"""

from __future__ import annotations

from torch import nn

from .audio_encoder import AudioEncoder
from .code2wav import Code2Wav
from .config import OmniConfig, TalkerConfig, ThinkerConfig
from .text import CodePredictorModel, TextModel, silu_module
from .vision_encoder import VisionEncoder


class ThinkerModel(nn.Module):
    def __init__(self, config: ThinkerConfig):
        super().__init__()
        self.audio_tower = AudioEncoder(config.audio_config)
        self.visual = VisionEncoder(config.vision_config)
        self.language_model = TextModel(config.text_config, "thinker_config.text_config")


class ThinkerModule(nn.Module):
    def __init__(self, config: ThinkerConfig):
        super().__init__()
        self.model = ThinkerModel(config)
        tc = config.text_config
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)


class ResizeMLP(nn.Module):
    """The talker's projections of thinker states (text embeddings, multimodal hidden states) to its width."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        tc = config.text_config
        self.linear_fc1 = nn.Linear(config.thinker_hidden_size, tc.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(tc.intermediate_size, tc.hidden_size, bias=True)
        self.act_fn = silu_module(tc.hidden_act, "talker_config.text_config")

    def forward(self, x):
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class CodePredictorModule(nn.Module):
    def __init__(self, config: TalkerConfig):
        super().__init__()
        cp = config.code_predictor_config
        self.config = cp
        self.model = CodePredictorModel(cp, "talker_config.code_predictor_config")
        self.lm_head = nn.ModuleList(nn.Linear(cp.hidden_size, cp.vocab_size, bias=False)
                                     for _ in range(cp.num_code_groups - 1))


class TalkerModule(nn.Module):
    def __init__(self, config: TalkerConfig):
        super().__init__()
        tc = config.text_config
        self.model = TextModel(tc, "talker_config.text_config", talker=True)
        self.text_projection = ResizeMLP(config)
        self.hidden_projection = ResizeMLP(config)
        self.codec_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        self.code_predictor = CodePredictorModule(config)


class OmniModel(nn.Module):
    """thinker, and talker and code2wav unless the config disables audio output."""

    def __init__(self, config: OmniConfig):
        super().__init__()
        self.config = config
        self.thinker = ThinkerModule(config.thinker_config)
        if config.talker_config is not None:
            self.talker = TalkerModule(config.talker_config)
            self.code2wav = Code2Wav(config.code2wav_config)


__all__ = ["OmniModel"]
