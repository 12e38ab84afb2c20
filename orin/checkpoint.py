"""A quantized orin-omni checkpoint as the loader sees it: the manifest, verified, and an index of which
tensors of which file belong to which component and which INT4 module."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import components as C
from .errors import ModelError

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate|up|down)_proj$")


def int4_module_of(key: str) -> str | None:
    """The INT4 module a checkpoint key belongs to (GPTQ tensors), or None for a plain tensor."""
    for suffix in (".qweight", ".qzeros", ".scales", ".g_idx"):
        if key.endswith(suffix):
            module = key[: -len(suffix)]
            match = _EXPERT.match(module)
            return match.group(1) if match else module
    return None


@dataclass
class Source:
    """One safetensors file's tensors of one component."""

    path: Path
    plain_keys: list[str] = field(default_factory=list)
    int4_modules: dict[str, list[str]] = field(default_factory=dict)

    @contextlib.contextmanager
    def open(self, device) -> Iterator:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device=str(device)) as reader:
                yield reader
        except OSError as exc:
            raise ModelError(f"{self.path}: cannot read ({exc})") from exc


@dataclass
class Checkpoint:
    root: Path
    config: object
    manifest: object
    by_component: dict[str, list[Source]]
    quantized_modules: set[str]

    def sources(self, component: str) -> list[Source]:
        return self.by_component.get(component, [])

    @property
    def name(self) -> str:
        return self.root.resolve().name

    @classmethod
    def open(cls, model_dir: str | Path, verify: bool = True) -> Checkpoint:
        from safetensors import safe_open

        from .manifest import read_manifest, verify_files
        from .modelcfg import load_config

        root = Path(model_dir)
        if not root.is_dir():
            raise ModelError(f"{root}: no such directory; give the --out directory of orin-omni quantize")
        if not (root / "manifest.json").is_file():
            raise ModelError(f"{root}: no manifest.json; this is not an orin-omni checkpoint. "
                             f"Run: orin-omni quantize {root} --out DIR, then use DIR")
        manifest = read_manifest(root)
        if verify:
            verify_files(root, manifest)
        config = load_config(root)
        by_component: dict[str, list[Source]] = {}
        quantized: set[str] = set()
        for path in manifest.safetensors_files():
            file = root / path
            per_comp: dict[str, Source] = {}
            try:
                with safe_open(str(file), framework="pt") as reader:
                    keys = list(reader.keys())
            except OSError as exc:
                raise ModelError(f"{file}: not a readable safetensors file ({exc})") from exc
            for key in keys:
                comp = C.component_of(key)
                if comp is None:
                    raise ModelError(f"{file}: tensor {key} belongs to no Qwen3-Omni component")
                src = per_comp.setdefault(comp, Source(file))
                module = int4_module_of(key)
                if module is None:
                    src.plain_keys.append(key)
                else:
                    src.int4_modules.setdefault(module, []).append(key)
                    quantized.add(module)
            for comp, src in per_comp.items():
                # An INT4 Linear's bias is stored beside its GPTQ tensors and loaded with them.
                for key in [k for k in src.plain_keys if k.endswith(".bias") and k[:-5] in src.int4_modules]:
                    src.plain_keys.remove(key)
                    src.int4_modules[key[:-5]].append(key)
                by_component.setdefault(comp, []).append(src)
        absent = [c for c in C.NAMES if c not in by_component]
        if absent:
            raise ModelError(f"{root}: the checkpoint has no tensors for {', '.join(absent)}; quantize every segment "
                             "(orin-omni quantize without --segments) before serving")
        return cls(root, config, manifest, by_component, quantized)
