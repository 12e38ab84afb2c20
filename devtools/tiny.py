"""A tiny random Qwen3-Omni, built fully offline: the demo's default model and the tests' fixture.

Every sub-model (thinker text decoder, audio encoder, vision encoder, talker, code predictor, code2wav) is
present and initialised, and the layers `quantize` touches have in_features that are multiples of 128, so GPTQ
with the default group size applies. The vision MLP's `linear_fc2` is deliberately 200 wide, not a multiple of
128, so the padding path that the real model's 4304-wide layer needs is exercised by every test.

Special-token ids are remapped into a 320-entry vocabulary (the real ones are ~152k, which would make the
embedding the largest tensor of the model); the config, tokenizer and chat template agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orin.errors import UsageError
from orin.fsutil import atomic_dir, atomic_write_json, atomic_write_text

# Byte-level base vocabulary: ids 0..255 are the 256 bytes, then whole-word role tokens (the talker finds
# the user turns by the token right after <|im_start|>), then the special tokens, then padding up to 320.
ROLE_TOKENS = ("user", "assistant", "system")
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)
TEXT_VOCAB = 320
CODEBOOK = 64  # codec codebook size; the talker vocabulary adds the 1024 ids generate() suppresses
TALKER_VOCAB = CODEBOOK + 1024


def _token_ids() -> dict[str, int]:
    ids = {}
    next_id = 256
    for tok in ROLE_TOKENS + SPECIAL_TOKENS:
        ids[tok] = next_id
        next_id += 1
    return ids


TOKEN_IDS = _token_ids()

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' or part['type'] == 'image_url' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'audio' or part['type'] == 'input_audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyModelConfig:
    out: str
    seed: int = 0
    force: bool = False


def tiny_config_dict() -> dict:
    """The tiny model's config.json content (a real Qwen3OmniMoeConfig, small)."""
    t = TOKEN_IDS
    rope = {"rope_theta": 1000000, "rope_type": "default", "mrope_section": [6, 5, 5], "interleaved": True,
            "mrope_interleaved": True, "type": "default"}
    audio = {
        "model_type": "qwen3_omni_moe_audio_encoder", "d_model": 128, "encoder_attention_heads": 4,
        "encoder_ffn_dim": 256, "encoder_layers": 2, "num_mel_bins": 128, "downsample_hidden_size": 32,
        "output_dim": 128, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
        "max_source_positions": 1500, "activation_function": "gelu", "scale_embedding": False,
    }
    speakers = {"chelsie": CODEBOOK + 253, "ethan": CODEBOOK + 254, "aiden": CODEBOOK + 255}
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "dtype": "bfloat16",
        "enable_audio_output": True,
        "im_start_token_id": t["<|im_start|>"],
        "im_end_token_id": t["<|im_end|>"],
        "system_token_id": t["system"],
        "user_token_id": t["user"],
        "assistant_token_id": t["assistant"],
        "tts_pad_token_id": t["<|tts_pad|>"],
        "tts_bos_token_id": t["<|tts_bos|>"],
        "tts_eos_token_id": t["<|tts_eos|>"],
        "thinker_config": {
            "model_type": "qwen3_omni_moe_thinker",
            "audio_token_id": t["<|audio_pad|>"], "image_token_id": t["<|image_pad|>"],
            "video_token_id": t["<|video_pad|>"], "audio_start_token_id": t["<|audio_start|>"],
            "audio_end_token_id": t["<|audio_end|>"], "vision_start_token_id": t["<|vision_start|>"],
            "vision_end_token_id": t["<|vision_end|>"], "user_token_id": t["user"],
            "position_id_per_seconds": 13, "seconds_per_chunk": 2, "tie_word_embeddings": False,
            "audio_config": audio,
            "vision_config": {
                "model_type": "qwen3_omni_moe_vision_encoder", "depth": 3, "hidden_size": 128, "num_heads": 4,
                "intermediate_size": 200, "out_hidden_size": 128, "patch_size": 16, "spatial_patch_size": 16,
                "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "in_chans": 3,
                "num_position_embeddings": 2304, "deepstack_visual_indexes": [1, 2], "hidden_act": "gelu_pytorch_tanh",
                "apply_vit_abs_pos_embed": True, "image_size": 768, "tokens_per_second": 2,
            },
            "text_config": {
                "model_type": "qwen3_omni_moe_text", "hidden_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
                "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                "vocab_size": TEXT_VOCAB, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
                "use_qk_norm": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
                "rope_parameters": rope, "tie_word_embeddings": False, "shared_expert_intermediate_size": 0,
            },
        },
        "talker_config": {
            "num_code_groups": 4, "thinker_hidden_size": 128, "accept_hidden_layer": 1,
            "codec_pad_id": CODEBOOK + 100, "codec_bos_id": CODEBOOK + 101, "codec_eos_token_id": CODEBOOK + 102,
            "codec_nothink_id": CODEBOOK + 107, "codec_think_bos_id": CODEBOOK + 108,
            "codec_think_eos_id": CODEBOOK + 109,
            "audio_token_id": t["<|audio_pad|>"], "image_token_id": t["<|image_pad|>"],
            "video_token_id": t["<|video_pad|>"], "vision_start_token_id": t["<|vision_start|>"],
            "audio_start_token_id": t["<|audio_start|>"], "audio_end_token_id": t["<|audio_end|>"],
            "position_id_per_seconds": 13, "seconds_per_chunk": 2, "spatial_merge_size": 2,
            "speaker_id": speakers,
            "text_config": {
                "model_type": "qwen3_omni_moe_talker_text", "hidden_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
                "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "num_experts": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                "vocab_size": TALKER_VOCAB, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rope_parameters": rope,
            },
            "code_predictor_config": {
                "model_type": "qwen3_omni_moe_talker_code_predictor", "hidden_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
                "vocab_size": CODEBOOK, "num_code_groups": 4, "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6, "hidden_act": "silu", "layer_types": ["full_attention"] * 2,
                "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
            },
        },
        "code2wav_config": {
            "codebook_size": CODEBOOK, "num_quantizers": 4, "num_semantic_quantizers": 1,
            "semantic_codebook_size": 128, "codebook_dim": 32, "vector_quantization_hidden_dimension": 32,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "decoder_dim": 64, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2], "sliding_window": 72, "max_position_embeddings": 8000,
            "rope_parameters": {"rope_theta": 10000, "rope_type": "default"}, "hidden_act": "silu",
        },
    }


def build_tiny_model(seed: int = 0):
    """The tiny model in memory, every parameter initialised deterministically from `seed`."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from quantize.hf_config import fix_config, new_config

    config = fix_config(new_config(tiny_config_dict()))
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config)
    _fix_init(model, seed)
    model.eval()
    return model


def _fix_init(model, seed: int) -> None:
    """transformers' random init leaves the talker's fused experts uninitialised (values ~1e-43) and every
    router at zero, so routing would be a tie. Draw them from a seeded generator with a router spread wide
    enough that tokens really take different experts."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif not torch.isfinite(param).all():
                raise RuntimeError(f"tiny model parameter {name} is not finite after init")


def build_processor():
    """The tiny model's processor: its byte-level tokenizer and chat template in quantize.hf_processor's processor."""
    from quantize.hf_processor import make_processor

    return make_processor(_build_tokenizer(), CHAT_TEMPLATE)


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in ROLE_TOKENS])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    if tok.get_vocab_size() > TEXT_VOCAB:
        raise RuntimeError("tiny tokenizer outgrew its vocabulary")
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok):
    """A `tokenizers.Tokenizer` with Qwen3-Omni's special tokens as the transformers tokenizer the processor
    expects: the media placeholders it looks up by attribute, EOS and padding, and the chat template."""
    from transformers import PreTrainedTokenizerFast

    extra = {
        "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_specific_special_tokens=extra, chat_template=CHAT_TEMPLATE,
    )


def write_tiny_model(cfg: TinyModelConfig) -> Path:
    """Write the tiny checkpoint to cfg.out: config.json, model.safetensors (bf16), tokenizer, processor
    configs and chat template. Built in a temporary directory and renamed into place."""
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not cfg.force:
        raise UsageError(f"{out} exists and is not empty; pass --force to overwrite it")
    import torch

    with atomic_dir(out) as tmp:
        model = build_tiny_model(cfg.seed).to(torch.bfloat16)
        model.save_pretrained(tmp)
        processor = build_processor()
        processor.save_pretrained(tmp)
        atomic_write_text(tmp / "chat_template.jinja", CHAT_TEMPLATE)
        atomic_write_json(tmp / "orin_tiny.json", {"seed": cfg.seed, "token_ids": TOKEN_IDS})
    return out
