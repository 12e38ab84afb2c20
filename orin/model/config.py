"""config.json of a Qwen3-Omni checkpoint, read into orin-omni's own frozen dataclasses: the device side's model
configuration, with no transformers involved.

Attribute names are config.json's keys (which are also transformers' attribute names), so every module reads
`config.thinker_config.text_config.hidden_size` whichever side built the config. A key the file leaves out takes
the default of transformers 5.23's config class for that section (so a checkpoint that relies on a default means
what it means there); the few keys with two spellings in the wild (`num_local_experts` for the talker's
`num_experts`, `rope_theta` at the section's top level or under `rope_parameters`) are read under either.
The audio and vision encoders and code2wav keep their own config classes beside their modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..errors import ModelError
from .config_file import read_config_dict
from .fields import declared_values


def _section(data: Mapping, key: str, where: str) -> Mapping:
    part = data.get(key)
    if part is None:
        return {}
    if not isinstance(part, Mapping):
        raise ModelError(f"config.json: {where}.{key} must be an object, got {type(part).__name__}")
    return part


@dataclass(frozen=True)
class TextConfig:
    """A MoE text decoder: the thinker's (`thinker_config.text_config`) or the talker's
    (`talker_config.text_config`, whose defaults differ: see `talker_defaults`)."""

    vocab_size: int = 3584
    hidden_size: int = 2048
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, ...] = (24, 20, 20)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_dict(cls, data: Mapping, where: str, **defaults) -> TextConfig:
        declared = declared_values(cls, data, "default", where, {"num_experts": "num_local_experts"})
        config = cls(**{**defaults, **declared})
        if config.head_dim is None:
            object.__setattr__(config, "head_dim", config.hidden_size // config.num_attention_heads)
        _check_heads(config, where)
        if len(config.mrope_section) != 3 or 2 * sum(config.mrope_section) != config.head_dim:
            raise ModelError(f"{where}: rope_parameters.mrope_section {list(config.mrope_section)} must be three "
                             f"numbers summing to head_dim / 2 = {config.head_dim // 2}")
        if config.num_experts_per_tok > config.num_experts:
            raise ModelError(f"{where}: num_experts_per_tok {config.num_experts_per_tok} exceeds num_experts "
                             f"{config.num_experts}")
        return config

    def is_moe_layer(self, index: int) -> bool:
        """transformers' rule for which decoder layers are sparse (the thinker's; the talker's all are)."""
        return (index not in self.mlp_only_layers and self.num_experts > 0
                and (index + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class CodePredictorConfig:
    """`talker_config.code_predictor_config`: the dense decoder that fills a codec frame's residual groups."""

    vocab_size: int = 2048
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_theta: float = 10000.0
    num_code_groups: int = 32

    @classmethod
    def from_dict(cls, data: Mapping, where: str) -> CodePredictorConfig:
        config = cls(**declared_values(cls, data, "default", where))
        _check_heads(config, where)
        return config


def _check_heads(config, where: str) -> None:
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size"):
        value = getattr(config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelError(f"{where}.{key} must be a positive integer, got {value!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ModelError(f"{where}: num_attention_heads {config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {config.num_key_value_heads}")


# transformers' Qwen3OmniMoeTalkerTextConfig defaults where they differ from the thinker's text config
TALKER_TEXT_DEFAULTS = {"vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "moe_intermediate_size": 384,
                        "norm_topk_prob": False, "rope_theta": 10000.0}


@dataclass(frozen=True)
class ThinkerConfig:
    text_config: TextConfig
    audio_config: object  # orin.model.audio_encoder.AudioEncoderConfig
    vision_config: object  # orin.model.vision_encoder.VisionConfig
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    audio_start_token_id: int = 151647
    vision_start_token_id: int = 151652
    user_token_id: int = 872
    position_id_per_seconds: int = 25


@dataclass(frozen=True)
class TalkerConfig:
    text_config: TextConfig
    code_predictor_config: CodePredictorConfig
    num_code_groups: int = 32
    thinker_hidden_size: int = 2048
    accept_hidden_layer: int = 18
    codec_eos_token_id: int = 4198
    codec_nothink_id: int = 4203
    codec_think_bos_id: int = 4204
    codec_think_eos_id: int = 4205
    codec_pad_id: int = 4196
    codec_bos_id: int = 4197
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    spatial_merge_size: int = 2
    speaker_id: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class OmniConfig:
    """The whole checkpoint's config. `raw` is config.json as read (orin.model.positions takes it)."""

    thinker_config: ThinkerConfig
    talker_config: TalkerConfig | None  # None where enable_audio_output is false: no talker, no code2wav
    code2wav_config: object | None  # orin.model.code2wav.Code2WavConfig
    raw: Mapping
    enable_audio_output: bool = True
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    system_token_id: int = 8948
    user_token_id: int = 872
    assistant_token_id: int = 77091


def _plain(cls, data: Mapping, skip: set[str]) -> dict:
    from dataclasses import fields

    return {f.name: data[f.name] for f in fields(cls) if f.name not in skip and data.get(f.name) is not None}


def omni_config(data: Mapping) -> OmniConfig:
    """An OmniConfig from config.json's content (a dict), or a ModelError naming the bad key."""
    from .audio_encoder import AudioEncoderConfig
    from .code2wav import Code2WavConfig
    from .vision_encoder import VisionConfig

    th = _section(data, "thinker_config", "config")
    try:
        thinker = ThinkerConfig(
            text_config=TextConfig.from_dict(_section(th, "text_config", "thinker_config"),
                                             "thinker_config.text_config"),
            audio_config=AudioEncoderConfig.from_dict(_section(th, "audio_config", "thinker_config")),
            vision_config=VisionConfig.from_dict(_section(th, "vision_config", "thinker_config")),
            **_plain(ThinkerConfig, th, {"text_config", "audio_config", "vision_config"}))
        audio_out = bool(data.get("enable_audio_output", True))
        talker = code2wav = None
        if audio_out:
            tk = _section(data, "talker_config", "config")
            cp = _section(tk, "code_predictor_config", "talker_config")
            talker = TalkerConfig(
                text_config=TextConfig.from_dict(_section(tk, "text_config", "talker_config"),
                                                 "talker_config.text_config", **TALKER_TEXT_DEFAULTS),
                code_predictor_config=CodePredictorConfig.from_dict(cp, "talker_config.code_predictor_config"),
                **{**_plain(TalkerConfig, tk, {"text_config", "code_predictor_config", "speaker_id"}),
                   "speaker_id": MappingProxyType({str(k).lower(): int(v)
                                                   for k, v in (tk.get("speaker_id") or {}).items()})})
            code2wav = Code2WavConfig.from_dict(_section(data, "code2wav_config", "config"))
        return OmniConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                          raw=MappingProxyType(dict(data)), enable_audio_output=audio_out,
                          **_plain(OmniConfig, data, {"thinker_config", "talker_config", "code2wav_config", "raw",
                                                      "enable_audio_output"}))
    except TypeError as exc:  # a value of the wrong kind where a dataclass computes with it
        raise ModelError(f"config.json: a value has the wrong type ({exc})") from exc


def load_omni_config(model: str | Path) -> OmniConfig:
    """The OmniConfig of a checkpoint directory or config.json, validated."""
    return omni_config(read_config_dict(model))


__all__ = ["CodePredictorConfig", "OmniConfig", "TalkerConfig", "TextConfig", "ThinkerConfig", "load_omni_config",
           "omni_config"]
