"""A random-weight Qwen3-Omni checkpoint at any dimensions, in exactly the layout `orin-omni quantize` writes.

Speed and memory do not depend on what the weights are, so the benchmark measures the real model's dimensions
without GPTQ and without downloading 70 GB: one shard per segment under hub names (GPTQ v1 INT4 tensors for every
target `orin.checkpoint.targets.find_targets` names, BF16 for the rest), config.json with its quantization_config, the index,
the tokenizer and chat template, and manifest.json with every file's size and sha256 (orin.checkpoint.files). The engine opens it like any quantized
checkpoint, so loading, swapping and time-slicing run the product's real code.

Random values follow `orin.checkpoint.gptq_format.random_gptq_v1` (codes uniform 0..15, zero points 4..11, scales
0.002..0.01) and transformers' initialisation for the BF16 parts (normal 0.02, norms one, biases zero). They
are drawn on the GPU when there is one and streamed to disk tensor by tensor, hashed on the way, so a 20 GB
checkpoint needs neither 20 GB of host memory nor a second pass to checksum it.

The tokenizer is synthetic too: byte-level single characters (ids 0..255), the chat roles and special tokens
at the ids the config names, and filler words (" t1234") for every other id, so any generated id decodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from orin import __version__
from orin import components as C
from orin.checkpoint.hub_names import is_fused_experts, to_hub
from orin.checkpoint.safetensors_stream import PlannedTensor, write_safetensors_stream
from orin.errors import ModelError, UsageError
from orin.fsutil import atomic_dir, atomic_write_json, atomic_write_text

# Special tokens the processor and chat template use, and where their ids live in the config.
_SPECIAL_IDS = {
    "<|im_start|>": ("im_start_token_id",),
    "<|im_end|>": ("im_end_token_id",),
    "<|tts_pad|>": ("tts_pad_token_id",),
    "<|tts_bos|>": ("tts_bos_token_id",),
    "<|tts_eos|>": ("tts_eos_token_id",),
    "<|audio_pad|>": ("thinker_config", "audio_token_id"),
    "<|image_pad|>": ("thinker_config", "image_token_id"),
    "<|video_pad|>": ("thinker_config", "video_token_id"),
    "<|audio_start|>": ("thinker_config", "audio_start_token_id"),
    "<|audio_end|>": ("thinker_config", "audio_end_token_id"),
    "<|vision_start|>": ("thinker_config", "vision_start_token_id"),
    "<|vision_end|>": ("thinker_config", "vision_end_token_id"),
}
_ROLE_IDS = {"user": ("user_token_id",), "assistant": ("assistant_token_id",), "system": ("system_token_id",)}
_BYTE_IDS = 256

TINY = "tiny"


@dataclass(frozen=True)
class SyntheticConfig:
    config: str  # a Qwen3-Omni config.json (or a checkpoint dir holding one), or "tiny"
    out: str
    device: str = "auto"  # where the random values are drawn: cuda is ~100x faster at real dimensions
    seed: int = 0
    group_size: int = 128
    force: bool = False


# ---------------------------------------------------------------------- config and tokenizer


def config_dict(config: str) -> dict:
    """The config.json content for `config` ("tiny" is devtools.tiny's model)."""
    if config == TINY:
        from .tiny import tiny_config_dict

        return tiny_config_dict()
    from orin.model.config_file import read_config_dict

    return read_config_dict(config)


def _lookup(data: dict, path: tuple[str, ...]) -> int:
    value: object = data
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelError(f"config.json: {'.'.join(path)} is missing or not an integer; cannot place its token")
    return value


def token_ids(data: dict) -> dict[str, int]:
    """Where the synthetic tokenizer puts each role and special token: the ids the config names."""
    ids = {tok: _lookup(data, path) for tok, path in {**_ROLE_IDS, **_SPECIAL_IDS}.items()}
    vocab = _lookup(data, ("thinker_config", "text_config", "vocab_size"))
    taken: dict[int, str] = {}
    for tok, i in ids.items():
        if not _BYTE_IDS <= i < vocab:
            raise ModelError(f"config.json: {tok} has id {i}, outside {_BYTE_IDS}..{vocab - 1}; the synthetic "
                             "tokenizer keeps ids 0..255 for bytes")
        if i in taken:
            raise ModelError(f"config.json: {tok} and {taken[i]} share id {i}")
        taken[i] = tok
    # <|endoftext|> (the pad token) is named nowhere in the config: just below <|im_start|> as in Qwen's
    # vocabulary, or the first free id.
    eot = ids["<|im_start|>"] - 1
    if eot in taken or eot < _BYTE_IDS:
        eot = next(i for i in range(_BYTE_IDS, vocab) if i not in taken)
    ids["<|endoftext|>"] = eot
    return ids


def synthetic_tokenizer(data: dict):
    """A fast tokenizer whose vocabulary covers every id of the model's text vocabulary (see module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken

    from .tiny import wrap_tokenizer

    ids = token_ids(data)
    vocab_size = _lookup(data, ("thinker_config", "text_config", "vocab_size"))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update(ids)
    used = set(vocab.values())
    # 'Ġ' is the byte-level space: filler id i decodes to " t{i}".
    vocab.update({f"\u0120t{i}": i for i in range(vocab_size) if i not in used})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Already in the vocabulary, so added at their own ids: roles match as whole words, specials as one token.
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in _ROLE_IDS])
    specials = [*_SPECIAL_IDS, "<|endoftext|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for name, i in ids.items():
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"synthetic tokenizer placed {name} at {tok.token_to_id(name)}, not {i}")
    return wrap_tokenizer(tok)


# ---------------------------------------------------------------------- the tensors of a segment


def _init_kind(module_class: str, param: str, ndim: int) -> tuple[str, float]:
    """transformers' initial value for a parameter that stays BF16 (see the tiny model's table of kinds)."""
    if param == "bias":
        return "const", 0.0
    if "Norm" in module_class:
        return "const", 1.0
    if module_class.endswith("LayerScale"):
        return "const", 0.01
    if module_class.endswith("ConvNeXtBlock") and param == "gamma":
        return "const", 1e-6
    if module_class.endswith("SnakeBeta"):
        return "const", 0.0
    return "normal", 0.02


def _gptq_plan(path: str, K: int, N: int, g: int, bias: bool) -> list[PlannedTensor]:
    import torch

    from orin.checkpoint.gptq_format import PACK

    groups = -(-K // g)
    out = [
        PlannedTensor(f"{path}.qweight", torch.int32, (-(-K // PACK), N)),
        PlannedTensor(f"{path}.qzeros", torch.int32, (groups, N // PACK)),
        PlannedTensor(f"{path}.scales", torch.float16, (groups, N)),
        PlannedTensor(f"{path}.g_idx", torch.int32, (K,)),
    ]
    if bias:
        out.append(PlannedTensor(f"{path}.bias", torch.bfloat16, (N,)))
    return out


def _int32_words(words64):
    """int64 values taken mod 2**32 -> the int32 with the same bit pattern."""
    import torch

    words64 = words64 & 0xFFFFFFFF
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


def random_experts_gptq(E: int, K: int, N: int, g: int, *, generator, device) -> dict:
    """Stacked random GPTQ v1 tensors of E same-shaped Linears (K multiple of g), each slice [e] distributed
    like `random_gptq_v1(K, N, g)`: codes uniform 0..15 (random words), zero points 4..11, scales 0.002..0.01."""
    import torch

    from orin.checkpoint.gptq_format import PACK, V1_ZERO_OFFSET

    if K % g or N % PACK:
        raise ValueError(f"stacked experts need K % g == 0 and N % 8 == 0, got K={K}, N={N}, g={g}")
    groups = K // g
    qweight = torch.randint(0, 256, (E, K // PACK, N, 4), dtype=torch.uint8, generator=generator,
                            device=device).view(torch.int32).squeeze(-1)
    zeros = torch.randint(4, 12, (E, groups, N // PACK, PACK), dtype=torch.int64, generator=generator,
                          device=device)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=device)
    qzeros = _int32_words((zeros << shifts).sum(-1) - V1_ZERO_OFFSET)
    scales = (torch.rand((E, groups, N), generator=generator, device=device) * 0.008 + 0.002).to(torch.float16)
    g_idx = torch.arange(K, dtype=torch.int32, device=device) // g
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


class _Segment:
    """The planned tensors of one segment and a generator that yields them in that order."""

    def __init__(self, model, components: tuple[str, ...], targets, g: int, device, generator):
        self.model, self.components, self.g, self.device, self.gen = model, components, g, device, generator
        self.targets = [t for t in targets if t.component in components]
        replaced = set()
        for t in self.targets:
            replaced.update((f"{t.path}.weight", f"{t.path}.bias") if t.kind == "linear"
                            else (f"{t.path}.gate_up_proj", f"{t.path}.down_proj"))
        import torch

        owners = {}
        for mname, module in model.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                owners[f"{mname}.{pname}" if mname else pname] = (type(module).__name__, pname)
        self.plain = []  # (name, shape, dtype, init kind)
        for name, p in model.named_parameters():
            if C.component_of(name) not in components or name in replaced:
                continue
            dtype = torch.bfloat16 if p.is_floating_point() else p.dtype
            self.plain.append((name, tuple(p.shape), dtype, _init_kind(*owners[name], p.dim())))
        plan = [PlannedTensor(n, d, s) for n, s, d, _ in self.plain]
        for t in self.targets:
            for suffix, K, N, bias in t.linears():
                plan.extend(_gptq_plan(t.path + suffix, K, N, g, bias))
        fused = [p.name for p in plan if is_fused_experts(p.name)]
        if fused:
            raise ModelError(f"{fused[0]}: BF16 fused experts; the synthetic checkpoint quantizes every MoE layer")
        self.plan = [PlannedTensor(to_hub(p.name), p.dtype, p.shape) for p in plan]  # stored under hub names

    def tensors(self) -> Iterator[tuple[str, object]]:
        for name, tensor in self._runtime_tensors():
            yield to_hub(name), tensor

    def _runtime_tensors(self) -> Iterator[tuple[str, object]]:
        import torch

        from orin.checkpoint.gptq_format import random_gptq_v1

        for name, shape, dtype, (kind, value) in self.plain:
            if kind == "const":
                t = torch.full(shape, value, dtype=torch.float32, device=self.device)
            else:
                t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32).mul_(value)
            yield name, t.to(dtype)
        for t in self.targets:
            if t.kind == "linear":
                parts = random_gptq_v1(t.in_features, t.out_features, self.g, generator=self.gen,
                                       device=self.device, bias=t.bias)
                for key in ("qweight", "qzeros", "scales", "g_idx", "bias"):
                    if key in parts:
                        yield f"{t.path}.{key}", parts[key]
                continue
            E, H, inter = t.num_experts, t.in_features, t.intermediate
            stacks = {
                "gate_proj": random_experts_gptq(E, H, inter, self.g, generator=self.gen, device=self.device),
                "up_proj": random_experts_gptq(E, H, inter, self.g, generator=self.gen, device=self.device),
                "down_proj": random_experts_gptq(E, inter, t.out_features, self.g, generator=self.gen,
                                                 device=self.device),
            }
            for e in range(E):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    s = stacks[proj]
                    for key in ("qweight", "qzeros", "scales"):
                        yield f"{t.path}.{e}.{proj}.{key}", s[key][e]
                    yield f"{t.path}.{e}.{proj}.g_idx", s["g_idx"]
            del stacks


# ---------------------------------------------------------------------- the checkpoint


def write_synthetic_checkpoint(cfg: SyntheticConfig, log: Callable[[str], None] = lambda _m: None) -> Path:
    """Write the random checkpoint to cfg.out (built in OUT/.synthetic.tmp, renamed into place). Returns OUT."""
    import torch

    from orin.checkpoint.files import model_quantization_config, segment_shards, write_config_files, write_index
    from orin.checkpoint.manifest import FileEntry, Manifest, SegmentEntry, file_entry, utc_now, write_manifest
    from orin.checkpoint.targets import QuantSpec, find_targets
    from orin.memory.skeleton import params_on_meta
    from orin.model.config import load_omni_config
    from orin.model.omni import OmniModel

    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not cfg.force:
        raise UsageError(f"{out} exists and is not empty; pass --force to overwrite it")
    data = config_dict(cfg.config)
    from orin.device.select import pick_device

    device = pick_device(cfg.device)
    spec = QuantSpec(group_size=cfg.group_size)
    with atomic_dir(out, "synthetic.tmp") as tmp:
        atomic_write_json(tmp / "config.json", data)
        with params_on_meta():
            model = OmniModel(load_omni_config(tmp))
        targets = find_targets(model, spec)
        write_config_files(tmp, data, model_quantization_config(model, spec, targets, 0.0, "synthetic-random"))
        synthetic_tokenizer(data).save_pretrained(tmp)
        from .tiny import CHAT_TEMPLATE

        atomic_write_text(tmp / "chat_template.jinja", CHAT_TEMPLATE)
        shared = tuple(file_entry(tmp, p.name) for p in sorted(tmp.iterdir()) if p.is_file())
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        segments = {}
        shards = segment_shards(C.DEFAULT_SEGMENTS)
        for name, comps in C.DEFAULT_SEGMENTS.items():
            start = utc_now()
            t0 = time.perf_counter()
            seg = _Segment(model, comps, targets, cfg.group_size, device, gen)
            size, sha = write_safetensors_stream(tmp / shards[name], seg.plan, seg.tensors(),
                                                 {"format": "pt", "orin_synthetic": "random"})
            files = (FileEntry(shards[name], size, sha),)
            payload = sum(p.nbytes for p in seg.plan)
            segments[name] = SegmentEntry(
                name=name, components=comps, files=files, total_bytes=sum(f.bytes for f in files),
                int4_bytes=payload, quantized_modules=tuple(t.path for t in seg.targets), started_at=start,
                finished_at=utc_now(), extra={"synthetic": True, "seed": cfg.seed},
            )
            log(f"segment {name}: {len(seg.plan)} tensors, {payload / 2**30:.2f} GiB in "
                f"{time.perf_counter() - t0:.1f} s")
        write_index(tmp, list(shards.values()))
        manifest = Manifest(
            tool_version=__version__, created_at=utc_now(),
            source={"model_dir": f"synthetic:{cfg.config}", "config_sha256": _sha_of(shared, "config.json")},
            quantization={**spec.describe(), "spec": asdict(spec), "quantizer": "synthetic-random"},
            split=dict(C.DEFAULT_SEGMENTS), shared_files=shared, segments=segments,
        )
        write_manifest(tmp, manifest)
    return out


def _sha_of(entries, name: str) -> str:
    return next((e.sha256 for e in entries if e.path == name), "")


__all__ = [
    "SyntheticConfig",
    "TINY",
    "config_dict",
    "random_experts_gptq",
    "synthetic_tokenizer",
    "token_ids",
    "write_safetensors_stream",
    "write_synthetic_checkpoint",
]
