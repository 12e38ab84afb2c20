"""A random-weight Qwen3-Omni in the published BF16 checkpoint's layout: what `orin-omni quantize` reads, at any
dimensions, with as many thinker layers as the disk holds (the real model's BF16 weights are 66 GiB).

It is the input the quantize benchmark measures: the real widths of every component (thinker text decoder, audio
and vision encoders, talker, code predictor, code2wav) from a config.json, `thinker_layers` of the thinker's 48,
and the hub's safetensors naming, one BF16 tensor per expert and projection, in shards of about `shard_bytes`
with model.safetensors.index.json. Speed and memory of quantizing do not depend on the weights' values, so per
layer figures measured on it extrapolate to the real 48 layers. The talker reads the thinker's hidden states at
`accept_hidden_layer` (24): with fewer thinker layers it reads the last one.

Values are transformers' initialisation (normal 0.02; norms one, biases zero: devtools.synthetic's table),
drawn on the GPU when there is one and streamed to disk tensor by tensor (orin.checkpoint.safetensors_stream), so the
checkpoint is never in memory whole. The tokenizer and chat template are devtools.synthetic's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from orin.checkpoint.hub_names import is_fused_experts, to_hub, unfused_names
from orin.checkpoint.safetensors_stream import PlannedTensor, write_safetensors_stream
from orin.errors import UsageError
from orin.fsutil import atomic_dir, atomic_write_json, atomic_write_text

DEFAULT_SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class SyntheticBF16Config:
    config: str  # a Qwen3-Omni config.json (or a checkpoint dir holding one), or "tiny"
    out: str
    thinker_layers: int | None = None  # None: as many as the config has
    device: str = "auto"  # where the random values are drawn
    seed: int = 0
    shard_bytes: int = DEFAULT_SHARD_BYTES
    force: bool = False


def bf16_config(config: str, thinker_layers: int | None) -> dict:
    """The config.json content: `config`'s, with `thinker_layers` thinker text layers."""
    from .synthetic import config_dict

    data = config_dict(config)
    text = data["thinker_config"]["text_config"]
    full = int(text["num_hidden_layers"])
    if thinker_layers is not None:
        if not 1 <= thinker_layers <= full:
            raise UsageError(f"--thinker-layers {thinker_layers}: the config has {full}; give 1 to {full}")
        text["num_hidden_layers"] = thinker_layers
        talker = data.get("talker_config") or {}
        if talker.get("accept_hidden_layer", 0) > thinker_layers:
            talker["accept_hidden_layer"] = thinker_layers
    return data


@dataclass(frozen=True)
class _Entry:
    name: str  # hub name
    shape: tuple[int, ...]
    init: tuple[str, float]  # devtools.synthetic._init_kind

    @property
    def nbytes(self) -> int:
        n = 2
        for d in self.shape:
            n *= d
        return n


def plan_tensors(data: dict) -> list[_Entry]:
    """Every tensor of the checkpoint for config `data`, hub names, sorted by name: per-expert weights for the
    fused experts of transformers' tree."""
    import torch

    from orin.memory.skeleton import params_on_meta
    from orin.model.config import omni_config
    from orin.model.omni import OmniModel

    from .synthetic import _init_kind

    with params_on_meta():
        model = OmniModel(omni_config(data))
    owners = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = (type(module).__name__, pname)
    entries = []
    for name, param in model.named_parameters():
        if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RuntimeError(f"{name}: a {param.dtype} parameter; the BF16 checkpoint holds floats only")
        init = _init_kind(*owners[name], param.dim())
        if is_fused_experts(name):
            E, rows, cols = param.shape
            shape = (rows // 2, cols) if name.endswith("gate_up_proj") else (rows, cols)
            entries += [_Entry(hub, shape, init) for hub in unfused_names(name, E)]
        else:
            entries.append(_Entry(to_hub(name), tuple(param.shape), init))
    return sorted(entries, key=lambda e: e.name)


def _shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    held = 0
    for e in entries:
        if shards[-1] and held + e.nbytes > limit:
            shards.append([])
            held = 0
        shards[-1].append(e)
        held += e.nbytes
    return shards


def _values(entries: list[_Entry], generator, device) -> Iterator[tuple[str, object]]:
    import torch

    for e in entries:
        kind, value = e.init
        if kind == "const":
            t = torch.full(e.shape, value, dtype=torch.bfloat16, device=device)
        else:
            t = torch.randn(e.shape, generator=generator, device=device, dtype=torch.float32).mul_(value)
        yield e.name, t.to(torch.bfloat16)


def write_synthetic_bf16(cfg: SyntheticBF16Config, log: Callable[[str], None] = lambda _m: None) -> Path:
    """Write the checkpoint to cfg.out (built in OUT/.synthetic-bf16.tmp, renamed into place). Returns OUT."""
    import torch

    from orin.checkpoint.files import INDEX_NAME
    from orin.device.select import pick_device

    from .synthetic import synthetic_tokenizer
    from .tiny import CHAT_TEMPLATE

    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not cfg.force:
        raise UsageError(f"{out} exists and is not empty; pass --force to overwrite it")
    if cfg.shard_bytes < 1 << 20:
        raise UsageError(f"--shard-size {cfg.shard_bytes} bytes: give at least 1MiB")
    data = bf16_config(cfg.config, cfg.thinker_layers)
    device = pick_device(cfg.device)
    entries = plan_tensors(data)
    shards = _shards(entries, cfg.shard_bytes)
    total = sum(e.nbytes for e in entries)
    log(f"{len(entries)} tensors, {total / 2**30:.2f} GiB in {len(shards)} shard(s), drawn on {device}")
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with atomic_dir(out, "synthetic-bf16.tmp") as tmp:
        atomic_write_json(tmp / "config.json", data)
        synthetic_tokenizer(data).save_pretrained(tmp)
        atomic_write_text(tmp / "chat_template.jinja", CHAT_TEMPLATE)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            t0 = time.perf_counter()
            plan = [PlannedTensor(e.name, torch.bfloat16, e.shape) for e in shard]
            write_safetensors_stream(tmp / name, plan, _values(shard, gen, device), {"format": "pt"})
            weight_map.update({e.name: name for e in shard})
            log(f"{name}: {sum(e.nbytes for e in shard) / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
        atomic_write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return out
