"""Calibration activations where the memory plan puts them: on the compute device, in host memory, or on disk.

A stack's calibration (or held-out) conversations are a `CallStore`: per conversation one call of a layer, split
into the part every layer of the stack is called with alike (the keyword arguments: rotary embeddings, masks,
cu_seqlens; the positional arguments after the hidden states; the DeepStack extras) and the hidden states, which
each layer replaces. Iterating a store yields the calls on the compute device one at a time, whatever their
placement, so a stack's activations never need to fit on the device at once unless the plan says they do.

On disk each call is two files, `fixed-NNNNN.pt` (written once, with the pass state) and `hidden-NNNNN.pt` (one
per layer, in that layer's checkpoint directory: see quantize/partial.py), saved with torch.save and read back
with torch.load(weights_only=True). The same files make a run resumable in every placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

PLACEMENTS = ("device", "host", "disk")


def tree_to(value, device: torch.device):
    """`value` (tensors in tuples, lists and dicts) with every tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(tree_to(v, device) for v in value)
    if isinstance(value, list):
        return [tree_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: tree_to(v, device) for k, v in value.items()}
    return value


def tree_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tree_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tree_bytes(v) for v in value.values())
    return 0


def _save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def _load(path: Path):
    return torch.load(path, weights_only=True, map_location="cpu")


@dataclass(frozen=True)
class Spilled:
    """A tensor kept on disk (torch.save) until it is used."""

    path: Path

    def load(self) -> torch.Tensor:
        return _load(self.path)


def materialize(value):
    """`value`, read back from disk if it was spilled there."""
    return value.load() if isinstance(value, Spilled) else value


@dataclass
class Call:
    """One call of a layer: positional args (hidden states first) and keyword args, plus stack-level extras
    (DeepStack features) that apply between layers."""

    args: tuple
    kwargs: dict
    extra: dict = field(default_factory=dict)

    @property
    def hidden(self) -> torch.Tensor:
        return self.args[0]

    def with_hidden(self, hidden: torch.Tensor) -> Call:
        return Call((hidden,) + tuple(self.args[1:]), self.kwargs, self.extra)


@dataclass(frozen=True)
class Placement:
    """Where a store keeps its tensors ("device", "host" or "disk") and the compute device."""

    where: str
    device: torch.device

    @property
    def holder(self) -> torch.device:
        """Where tensors kept in memory live."""
        return self.device if self.where == "device" else torch.device("cpu")


class CallStore:
    """The calls of one stream of one stack (see the module docstring). `fixed_dir`/`hidden_dir` hold its files
    when its placement is disk (or once saved)."""

    def __init__(self, placement: Placement, fixed_dir: Path | None = None, hidden_dir: Path | None = None):
        self.placement = placement
        self.fixed_dir = fixed_dir
        self.hidden_dir = hidden_dir
        self._fixed: list = []  # per call (rest args, kwargs, extra), or None when on disk
        self._hidden: list = []  # per call the hidden states, or None when on disk
        self._rows: list[int] = []
        self.fixed_bytes = 0  # what the calls hold, wherever they are
        self.hidden_bytes = 0

    # ------------------------------------------------------------------ building

    def append(self, call: Call) -> None:
        fixed = (tuple(call.args[1:]), call.kwargs, call.extra)
        n = len(self._rows)
        self._rows.append(call.hidden.numel() // call.hidden.shape[-1])
        self.fixed_bytes += tree_bytes(fixed)
        self.hidden_bytes += tree_bytes(call.hidden)
        if self.placement.where == "disk":
            _save(tree_to(fixed, torch.device("cpu")), self._fixed_path(n))
            _save(call.hidden.cpu(), self._hidden_path(n))
            self._fixed.append(None)
            self._hidden.append(None)
        else:
            self._fixed.append(tree_to(fixed, self.placement.holder))
            self._hidden.append(call.hidden.to(self.placement.holder))

    def with_hidden(self, hiddens: Iterable[torch.Tensor], hidden_dir: Path | None) -> CallStore:
        """The same calls with new hidden states (a layer's outputs), kept where this store keeps its own."""
        new = CallStore(self.placement, self.fixed_dir, hidden_dir)
        new._fixed, new._rows, new.fixed_bytes = self._fixed, self._rows, self.fixed_bytes
        for n, hidden in enumerate(hiddens):
            new.hidden_bytes += tree_bytes(hidden)
            if self.placement.where == "disk":
                _save(hidden.cpu(), new._hidden_path(n))
                new._hidden.append(None)
            else:
                new._hidden.append(hidden.to(self.placement.holder))
        if len(new._hidden) != len(self._rows):
            raise RuntimeError(f"a layer gave {len(new._hidden)} outputs for {len(self._rows)} calls")
        return new

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> int:
        return sum(self._rows)

    def __iter__(self) -> Iterator[Call]:
        device = self.placement.device
        for n in range(len(self._rows)):
            fixed = self._fixed[n] if self._fixed[n] is not None else _load(self._fixed_path(n))
            hidden = self._hidden[n] if self._hidden[n] is not None else _load(self._hidden_path(n))
            rest, kwargs, extra = tree_to(fixed, device)
            yield Call((hidden.to(device),) + tuple(rest), kwargs, extra)

    # ------------------------------------------------------------------ files

    def _fixed_path(self, n: int) -> Path:
        if self.fixed_dir is None:
            raise RuntimeError("a store on disk needs a directory for its calls")
        return self.fixed_dir / f"fixed-{n:05d}.pt"

    def _hidden_path(self, n: int) -> Path:
        if self.hidden_dir is None:
            raise RuntimeError("a store on disk needs a directory for its hidden states")
        return self.hidden_dir / f"hidden-{n:05d}.pt"

    def save_fixed(self, directory: Path) -> None:
        """Write the calls' fixed parts (and, for a store still in memory, nothing else) under `directory`."""
        for n in range(len(self._rows)):
            if self._fixed[n] is None:
                continue  # on disk already, under the directory the pass state is renamed to
            _save(tree_to(self._fixed[n], torch.device("cpu")), directory / f"fixed-{n:05d}.pt")

    def save_hidden(self, directory: Path) -> None:
        """Write the hidden states the store keeps in memory under `directory` (those on disk are there)."""
        for n in range(len(self._rows)):
            if self._hidden[n] is not None:
                _save(self._hidden[n].cpu(), directory / f"hidden-{n:05d}.pt")

    def relocate(self, fixed_dir: Path | None = None, hidden_dir: Path | None = None) -> None:
        """Point the store at the directories its files were renamed into."""
        if fixed_dir is not None:
            self.fixed_dir = fixed_dir
        if hidden_dir is not None:
            self.hidden_dir = hidden_dir

    @classmethod
    def load(cls, placement: Placement, fixed_dir: Path, hidden_dir: Path, rows: list[int]) -> CallStore:
        """A store saved under `fixed_dir` and `hidden_dir` (its calls' row counts given), read into memory
        unless its placement is disk."""
        store = cls(placement, fixed_dir, hidden_dir)
        store._rows = list(rows)
        for n in range(len(rows)):
            if placement.where == "disk":
                store._fixed.append(None)
                store._hidden.append(None)
                store.fixed_bytes += (fixed_dir / f"fixed-{n:05d}.pt").stat().st_size
                store.hidden_bytes += (hidden_dir / f"hidden-{n:05d}.pt").stat().st_size
                continue
            fixed = tree_to(_load(fixed_dir / f"fixed-{n:05d}.pt"), placement.holder)
            hidden = _load(hidden_dir / f"hidden-{n:05d}.pt").to(placement.holder)
            store._fixed.append(fixed)
            store._hidden.append(hidden)
            store.fixed_bytes += tree_bytes(fixed)
            store.hidden_bytes += tree_bytes(hidden)
        return store

    def row_counts(self) -> list[int]:
        return list(self._rows)


class StackData:
    """First-layer calls of one stack: calibration calls feed the Hessians, held-out calls only the report."""

    def __init__(self, placement: Placement, directory: Path | None = None):
        self.calib = CallStore(placement, *(2 * (directory / "calib",) if directory else (None, None)))
        self.heldout = CallStore(placement, *(2 * (directory / "heldout",) if directory else (None, None)))

    def add(self, call: Call, heldout: bool) -> None:
        (self.heldout if heldout else self.calib).append(call)

    @property
    def calib_rows(self) -> int:
        return self.calib.rows
