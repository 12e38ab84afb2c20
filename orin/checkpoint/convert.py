"""`orin-omni convert`: an orin-omni 0.1 checkpoint rewritten in the standard GPTQ layout, without re-quantizing.

0.1 wrote one directory per segment (OUT/<segment>/model.safetensors, config.json, quantize_config.json) under
transformers 5.23's runtime names, every GPTQ Linear zero-padded to a multiple of the group size, and the vision
MLP's `linear_fc2` in INT4. The standard layout (orin.checkpoint.files) has one shard per segment at the root
under hub names, GPTQ tools' unpadded tensors (ceil(K/8) qweight rows, K g_idx entries) and `linear_fc2` in BF16,
whose width vLLM's GPTQ kernels refuse. Neither change alters what the model computes: the dropped rows held the
codes of padded input columns that only ever met zero activations, and fc2's BF16 weight is its INT4 weight
dequantized. The codes stay asymmetric, as 0.1 quantized them.

Tensors are streamed from the old shard to the new one one at a time (hashed on the way), so converting the
real model needs no more memory than its largest tensor.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .. import __version__
from .. import components as C
from ..errors import ModelError, UsageError
from .files import VISION_FC2_RULE, fused_experts_modules, read_header
from .hub_names import is_fused_experts, to_hub, to_runtime, unfused_names
from .safetensors_stream import PlannedTensor, write_safetensors_stream
from .targets import enabled_components

OLD_SCHEMA = 1
REPORT_NAME = "report.json"  # quantize's quality report: still true of the converted weights, so carried along
SYM_NOTE = ("the weights stay asymmetric (sym: false), as orin-omni 0.1 quantized them: transformers and orin-omni "
            "load this checkpoint as it is, but vLLM's GPTQ kernels take symmetric weights only; to serve it with "
            "vLLM, re-quantize the BF16 model with `orin-omni quantize MODEL --out DIR --sym`")
_GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
# Linears 0.1 quantized that the standard layout keeps in BF16 (the rule quantization_config declares them by).
_TO_BF16 = re.compile(VISION_FC2_RULE.removeprefix("-:"))
_EXPERT_LINEAR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj$")
_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass(frozen=True)
class ConvertConfig:
    model_dir: str  # an orin-omni 0.1 checkpoint (manifest schema 1)
    out: str  # the new directory
    force: bool = False  # replace an existing OUT


@dataclass(frozen=True)
class _Plain:
    """A tensor copied as it is (renamed; a fused BF16 experts tensor split into one weight per expert)."""

    key: str  # in the old file
    runtime: str
    dtype: object
    shape: tuple[int, ...]

    def plan(self) -> list[PlannedTensor]:
        if not is_fused_experts(self.runtime):
            return [PlannedTensor(to_hub(self.runtime), self.dtype, self.shape)]
        E, rows, cols = self.shape
        if self.runtime.endswith("gate_up_proj"):
            rows //= 2
        return [PlannedTensor(n, self.dtype, (rows, cols)) for n in unfused_names(self.runtime, E)]

    def tensors(self, reader) -> Iterator[tuple[str, object]]:
        from .files import hub_state

        yield from hub_state({self.runtime: reader.get_tensor(self.key)}).items()


@dataclass(frozen=True)
class _Linear:
    """One GPTQ Linear of the old file: its tensors' keys and header entries, and the model's true K and N."""

    path: str  # runtime module path
    keys: dict[str, str]  # qweight, qzeros, scales, g_idx[, bias] -> key in the old file
    header: dict[str, tuple[object, tuple[int, ...]]]  # same suffixes -> (torch dtype, shape) in the old file
    K: int
    N: int
    group_size: int
    to_bf16: bool = False  # a Linear the standard layout keeps in BF16: stored dequantized

    def plan(self) -> list[PlannedTensor]:
        import torch

        hub = to_hub(self.path)
        bias = [PlannedTensor(f"{hub}.bias", *self.header["bias"])] if "bias" in self.keys else []
        if self.to_bf16:
            return [PlannedTensor(f"{hub}.weight", torch.bfloat16, (self.N, self.K)), *bias]
        return [
            PlannedTensor(f"{hub}.qweight", self.header["qweight"][0], (-(-self.K // 8), self.N)),
            PlannedTensor(f"{hub}.qzeros", *self.header["qzeros"]),
            PlannedTensor(f"{hub}.scales", *self.header["scales"]),
            PlannedTensor(f"{hub}.g_idx", self.header["g_idx"][0], (self.K,)),
            *bias,
        ]

    def tensors(self, reader) -> Iterator[tuple[str, object]]:
        import torch

        from .gptq_format import check_in_features, dequantize_gptq_v1, gptq_v1_geometry

        t = {suffix: reader.get_tensor(key) for suffix, key in self.keys.items()}
        check_in_features(t["qweight"].shape[0] * 8, self.group_size, self.K, self.path)
        # GPTQ tools' layout: the rows of the zero-padded input columns dropped, one g_idx entry per input.
        t["qweight"] = t["qweight"][: -(-self.K // 8)].contiguous()
        t["g_idx"] = t["g_idx"][: self.K].contiguous()
        _, N, groups, g = gptq_v1_geometry(t, self.path)
        if N != self.N or groups != -(-self.K // self.group_size) or (groups > 1 and g != self.group_size):
            raise ModelError(f"{self.path}: GPTQ tensors of {N} outputs in {groups} groups of {g} do not match the "
                             f"model's Linear ({self.K} -> {self.N}, group size {self.group_size}); the checkpoint "
                             "does not match its config.json")
        hub = to_hub(self.path)
        if self.to_bf16:
            yield f"{hub}.weight", dequantize_gptq_v1(t, self.K, self.path).to(torch.bfloat16)
        else:
            for suffix in _GPTQ_SUFFIXES:
                yield f"{hub}.{suffix}", t[suffix]
        if "bias" in t:
            yield f"{hub}.bias", t["bias"]


@dataclass(frozen=True)
class _SegmentResult:
    shard_bytes: int
    sha256: str
    payload: int  # tensor bytes, without the header
    tensors: int
    linears: tuple[str, ...]  # runtime names of the GPTQ Linears still quantized, experts one per expert
    to_bf16: tuple[str, ...]  # runtime paths of the Linears dequantized to BF16


def convert_checkpoint(cfg: ConvertConfig, log: Callable[[str], None] = lambda _m: None) -> Path:
    """Rewrite the orin-omni 0.1 checkpoint cfg.model_dir as a standard GPTQ directory at cfg.out (built beside
    it and renamed into place). Returns OUT."""
    from ..fsutil import atomic_dir
    from ..memory.model_sizes import meta_model
    from ..model.config import load_omni_config
    from .files import quantization_config, segment_shards, write_config_files, write_index
    from .manifest import FileEntry, Manifest, SegmentEntry, file_entry, utc_now, verify_files, write_manifest

    src, out = Path(cfg.model_dir), Path(cfg.out)
    old = _old_manifest(src)
    _check_out(src, out, cfg.force)
    log(f"verifying {src} against its manifest (sha256 of every file)")
    verify_files(src, old)
    spec = replace(old.quant_spec(), sym=False)  # 0.1 quantized asymmetrically and recorded no `sym`
    source_config = _read_json(src / "config.json")
    source_config.pop("quantization_config", None)
    model = meta_model(load_omni_config(src))
    shards = segment_shards(old.split)
    with atomic_dir(out, "convert.tmp") as tmp:
        segments, linears = {}, []
        for name in old.split:
            entry = old.segment(name)
            files = [f.path for f in entry.files if f.path.endswith(".safetensors")]
            if len(files) != 1:
                raise ModelError(f"{src}: segment {name} has {len(files)} safetensors files, orin-omni 0.1 wrote "
                                 "one; this is not a checkpoint convert understands")
            result = _convert_segment(src / files[0], tmp / shards[name], model, spec.group_size)
            linears.extend(result.linears)
            dropped = set(result.to_bf16)
            segments[name] = SegmentEntry(
                name=name, components=entry.components,
                files=(FileEntry(shards[name], result.shard_bytes, result.sha256),),
                total_bytes=result.shard_bytes, int4_bytes=result.payload,
                quantized_modules=tuple(m for m in entry.quantized_modules if m not in dropped),
                started_at=entry.started_at, finished_at=entry.finished_at, extra=dict(entry.extra),
            )
            log(f"segment {name}: {result.tensors} tensors -> {shards[name]} ({result.shard_bytes / 2**20:.1f} MiB), "
                f"{len(result.linears)} GPTQ Linears, {len(result.to_bf16)} vision linear_fc2 dequantized to BF16")
        q = old.quantization
        qconfig = quantization_config(
            bits=spec.bits, group_size=spec.group_size, sym=spec.sym, damp=float(q.get("damp_percent", 0.05)),
            quantized_linears=linears, all_experts_quantized=_all_experts_quantized(model, linears),
            bf16_components=[c for c in C.NAMES if c not in enabled_components(spec)],
            quantizer=str(q.get("quantizer", "gptq")))
        copied = [f.path for f in old.shared_files if f.path != "config.json"]
        for rel in copied:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, tmp / rel)
        names = copied + write_config_files(tmp, source_config, qconfig)
        if (src / REPORT_NAME).is_file():
            shutil.copyfile(src / REPORT_NAME, tmp / REPORT_NAME)
        write_index(tmp, list(shards.values()))
        write_manifest(tmp, Manifest(
            tool_version=old.tool_version, created_at=utc_now(),
            source={**old.source, "converted_from": {"model_dir": str(src.resolve()), "schema_version": OLD_SCHEMA,
                                                     "tool": f"orin-omni {__version__} convert"}},
            quantization={**q, **spec.describe(), "spec": asdict(spec)},
            split=dict(old.split), shared_files=tuple(file_entry(tmp, n) for n in names), segments=segments,
            served_model_name=old.served_model_name,
        ))
    log(f"note: {SYM_NOTE}")
    return out


def convert_summary(out: str | Path) -> dict:
    """What `orin-omni convert --json` prints: the new manifest's summary and the symmetry caveat."""
    from .manifest import read_manifest

    manifest = read_manifest(out)
    return {"out": str(out), **manifest.summary(), "sym": manifest.quant_spec().sym, "note": SYM_NOTE}


# ---------------------------------------------------------------------- checks


def _old_manifest(src: Path):
    from .manifest import read_manifest

    if not src.is_dir():
        raise ModelError(f"{src}: no such directory; give the --out directory of an orin-omni 0.1 quantize run")
    if not (src / "manifest.json").is_file():
        raise ModelError(f"{src}: no manifest.json, so not an orin-omni 0.1 checkpoint; convert rewrites those only "
                         "(a GPTQ directory of another tool is already in the standard layout and loads as it is)")
    manifest = read_manifest(src)
    if manifest.schema_version != OLD_SCHEMA:
        raise UsageError(f"{src}: already in the standard layout (manifest schema {manifest.schema_version}); "
                         "nothing to convert: serve it, or load it in vLLM or transformers, as it is")
    unfinished = [n for n in manifest.split if n not in manifest.segments]
    if unfinished:
        raise ModelError(f"{src}: segment(s) {', '.join(unfinished)} were never finished; convert needs a complete "
                         "checkpoint: quantize the model again with this version (orin-omni quantize MODEL --out DIR)")
    return manifest


def _check_out(src: Path, out: Path, force: bool) -> None:
    src_abs, out_abs = src.resolve(), out.resolve()
    if out_abs == src_abs or out_abs in src_abs.parents:
        raise UsageError(f"--out {out} would replace the checkpoint being converted; give a new directory")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"{out} exists and is not empty; pass --force to replace it, or choose another --out")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path}: not a JSON object")
    return data


def _all_experts_quantized(model, linears: list[str]) -> bool:
    return fused_experts_modules(model) <= {m.group("experts") for m in map(_EXPERT_LINEAR.match, linears) if m}


# ---------------------------------------------------------------------- one segment


def _convert_segment(src: Path, dst: Path, model, group_size: int) -> _SegmentResult:

    units = _units(src, model, group_size)
    plan = [p for unit in units for p in unit.plan()]
    seen: set[str] = set()
    for p in plan:
        if p.name in seen:
            raise ModelError(f"{src}: two tensors would both be stored as {p.name}; the checkpoint is damaged")
        seen.add(p.name)
    size, sha = write_safetensors_stream(dst, plan, _tensors(src, units), {"format": "pt"})
    linears = [u for u in units if isinstance(u, _Linear)]
    return _SegmentResult(
        shard_bytes=size, sha256=sha, payload=sum(p.nbytes for p in plan), tensors=len(plan),
        linears=tuple(u.path for u in linears if not u.to_bf16), to_bf16=tuple(u.path for u in linears if u.to_bf16))


def _tensors(src: Path, units: list) -> Iterator[tuple[str, object]]:
    from safetensors import safe_open

    try:
        with safe_open(str(src), framework="pt", device="cpu") as reader:
            for unit in units:
                yield from unit.tensors(reader)
    except OSError as exc:
        raise ModelError(f"{src}: cannot read ({exc})") from exc


def _units(src: Path, model, group_size: int) -> list:
    """The old file's tensors as units to convert, in name order: GPTQ Linears (with their bias) and the rest."""
    header = {key: (_dtype(info.get("dtype"), src, key), tuple(info.get("shape", ()))) for key, info in
              read_header(src).items()}
    gptq: dict[str, dict[str, str]] = {}
    plain: dict[str, str] = {}  # runtime name -> key
    for key in header:
        runtime = to_runtime(key)
        if C.component_of(runtime) is None:
            raise ModelError(f"{src}: tensor {key} belongs to no Qwen3-Omni component")
        suffix = runtime.rpartition(".")[2]
        if suffix in _GPTQ_SUFFIXES:
            gptq.setdefault(runtime.rpartition(".")[0], {})[suffix] = key
        else:
            plain[runtime] = key
    units: dict[str, object] = {}
    for path, keys in gptq.items():
        missing = [s for s in _GPTQ_SUFFIXES if s not in keys]
        if missing:
            raise ModelError(f"{src}: {path} lacks its GPTQ {', '.join(missing)}; the checkpoint is damaged")
        if f"{path}.bias" in plain:
            keys["bias"] = plain.pop(f"{path}.bias")
        K, N = _linear_shape(model, path)
        units[path] = _Linear(path, keys, {s: header[k] for s, k in keys.items()}, K, N, group_size,
                              to_bf16=bool(_TO_BF16.fullmatch(path)))
    for runtime, key in plain.items():
        dtype, shape = header[key]
        if is_fused_experts(runtime) and len(shape) != 3:
            raise ModelError(f"{src}: {key} has shape {list(shape)}; fused experts tensors are 3-D")
        units[runtime] = _Plain(key, runtime, dtype, shape)
    return [units[name] for name in sorted(units)]


def _dtype(name: object, src: Path, key: str):
    import torch

    attr = _TORCH_DTYPES.get(str(name))
    if attr is None:
        raise ModelError(f"{src}: tensor {key} has dtype {name!r}, which no orin-omni checkpoint holds")
    return getattr(torch, attr)


def _linear_shape(model, path: str) -> tuple[int, int]:
    """(in_features, out_features) of the Linear at runtime path `path` in the model its config describes; an
    expert's Linear is a slice of its fused experts tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    import torch.nn as nn

    expert = _EXPERT_LINEAR.match(path)
    try:
        module = model.get_submodule(expert.group("experts") if expert else path)
    except AttributeError as exc:
        raise ModelError(f"the checkpoint quantizes {path}, which the model of its config.json does not have; "
                         "the checkpoint does not match its config") from exc
    if expert:
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if gate_up is None or down is None or int(expert.group("e")) >= gate_up.shape[0]:
            raise ModelError(f"the checkpoint quantizes {path}, which is no expert of the model of its config.json")
        if expert.group("proj") == "down":
            return int(down.shape[2]), int(down.shape[1])
        return int(gate_up.shape[2]), int(gate_up.shape[1]) // 2
    if not isinstance(module, nn.Linear):
        raise ModelError(f"the checkpoint quantizes {path}, a {type(module).__name__} in the model, not a Linear")
    return module.in_features, module.out_features


__all__ = ["ConvertConfig", "SYM_NOTE", "convert_checkpoint", "convert_summary"]
