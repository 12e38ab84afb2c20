"""Reading a unit's weights into the model skeleton (orin.memory.skeleton): its plain tensors straight from safetensors
onto the device in batches, its INT4 modules converted from their GPTQ tensors one module (one batch of experts)
at a time, so no component is ever held twice, or, where the unit has a valid packed copy (orin.memory.packed_cache),
read from it as they are; a unit converted is then written there for the next load. Every read goes through
orin.memory.block_reader, the next one started while this one is copied, assigned or converted."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import torch
from torch import nn

from .. import components as C
from ..checkpoint.hub_names import expert_part, to_runtime
from ..checkpoint.reader import Checkpoint
from ..device.gate import GATE
from ..device.profile import DeviceProfile
from ..errors import ModelError
from .arena import Arenas
from .block_reader import BlockReader
from .packed_cache import PackedCache
from .skeleton import Skeleton

log = logging.getLogger("orin.memory.loader")


class UnitReader:
    """Loads units of a component into the skeleton: `read(component, units, packed)`. The tensors go where the
    units' weights live: their arenas (orin.memory.arena) where the loader has them, else the allocator."""

    def __init__(self, skeleton: Skeleton, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 arenas: Arenas | None, profile: DeviceProfile):
        self.skeleton = skeleton
        self.ckpt = checkpoint
        self.device = device
        self.dtype = dtype
        self.profile = profile
        self._arenas = arenas

    def _batch_bytes(self) -> int:
        """The most bytes read in one batch: a staging buffer's, and no more than one range of a unit's arena holds
        (a batch's tensors land in one device block, which never straddles two ranges)."""
        stage = self.profile.memory.stage_bytes
        if self._arenas is None or self._arenas.max_reservation is None:
            return stage
        return min(stage, self._arenas.max_reservation)

    def _blocks(self, path) -> BlockReader:
        return BlockReader(path, self.device, self.profile.memory)

    def _keep(self, unit: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` where the unit's weights live: its arena (a copy, unless it was read there), or as it is."""
        return tensor if self._arenas is None else self._arenas.adopt(unit, tensor)

    def _keep_module(self, unit: str, module: nn.Module) -> None:
        """An INT4 module's buffers where the unit's weights live (through _apply, which also drops the views a
        module derived from its old buffers)."""
        if self._arenas is not None:
            module._apply(lambda t: self._arenas.adopt(unit, t), recurse=False)

    def _plain_alloc(self, blocks: BlockReader, batch: list[tuple[str, list[str]]]):
        """Where a batch of plain tensors is read to: straight into its unit's arena where each of them is kept as
        read (one unit's, each a whole runtime tensor, floats already in the runtime dtype); else (None) the
        allocator's memory, each tensor then copied to the arena by _keep."""
        if self._arenas is None:
            return None
        units = {C.unit_of(k) for k, _ in batch}
        if len(units) != 1 or any(len(fks) != 1 or expert_part(to_runtime(fks[0])) is not None for _, fks in batch):
            return None
        dtypes = {blocks.index[fks[0]][0] for _, fks in batch}
        if any(d.is_floating_point and d != self.dtype for d in dtypes):
            return None
        return self._arenas.of(units.pop()).take

    def _assign(self, key: str, tensor: torch.Tensor) -> int:
        module_path, _, name = key.rpartition(".")
        module = self.skeleton.model.get_submodule(module_path)
        unit = C.unit_of(key)
        if name in module._parameters:
            old = module._parameters[name]
            if tuple(old.shape) != tuple(tensor.shape):
                raise ModelError(f"{key}: checkpoint shape {tuple(tensor.shape)} does not match the model's "
                                 f"{tuple(old.shape)}; the checkpoint is for another model")
            if tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            module._parameters[name] = nn.Parameter(self._keep(unit, tensor), requires_grad=False)
        elif name in module._buffers:
            buf = module._buffers[name]
            tensor = tensor.to(buf.dtype) if buf is not None and buf.is_floating_point() else tensor
            # a copy: a view would keep the whole block it was read in alive past the unit's eviction
            module._buffers[name] = tensor.clone() if self._arenas is None else self._keep(unit, tensor)
        else:
            raise ModelError(f"{key}: the model has no such tensor; the checkpoint is for another model")
        return tensor.numel() * tensor.element_size()

    def read(self, component: str, units: set[str], packed: PackedCache | None) -> tuple[dict[str, int], int, int]:
        """Load these units of `component`: (the bytes each now holds, how many of them came from their packed
        copies in `packed`, how many packed copies were written there)."""
        from ..int4.linear import Int4Linear, load_int4_module

        shell_unit = self.skeleton.shell_unit
        got = dict.fromkeys(units, 0)
        shells = self.skeleton.shells_of(units)
        files = [source.path for source in self.ckpt.sources(component)]
        from_packed = 0
        if packed is not None:  # INT4 units with a valid packed copy: read, not converted
            from_packed = self._load_all_packed(packed, sorted({shell_unit[p] for p in shells}, key=C.unit_sort_key),
                                                files, shells, got)
        shells = {p: m for p, m in shells.items() if not m.is_loaded}
        plain_batch_bytes = self._batch_bytes()
        for source in self.ckpt.sources(component):
            blocks = self._blocks(source.path)
            with _LazyReader(source, self.device) as reader:
                modules = [(p, m) for p, m in source.int4_modules.items() if p in shells]
                plain = [(k, fks) for k, fks in source.plain.items() if C.unit_of(k) in got]
                batches = _plain_batches(blocks, plain, plain_batch_bytes)
                for i, batch in enumerate(batches):
                    with GATE:  # a batch in one read (the next one read meanwhile), views of one device block
                        # no gaps: a view must not keep bytes of other tensors (or other units) alive
                        then = [k for _, fks in batches[i + 1] for k in fks] if i + 1 < len(batches) else None
                        tensors = blocks.read([k for _, fks in batch for k in fks], max_gap=0, then=then,
                                              alloc=self._plain_alloc(blocks, batch))
                        if then is None and modules:
                            blocks.read_ahead(_first_read(shells, modules[0], self.profile))
                        for key, file_keys in batch:
                            got[C.unit_of(key)] += self._assign(
                                key, _assemble(key, file_keys, [tensors.pop(k) for k in file_keys]))
                for i, (path, int4) in enumerate(modules):
                    shell = shells[path]
                    # the next module's first read starts once this one has read all it needs (a Linear: at
                    # once; experts: with their last batch), so reading overlaps converting across modules too
                    then = _first_read(shells, modules[i + 1], self.profile) if i + 1 < len(modules) else []
                    tensors = _Relative(reader, int4.file_prefix, int4.keys, blocks, then)
                    with GATE:
                        if isinstance(shell, Int4Linear):
                            tensors.read_block(list(tensors))  # a Linear's tensors in one read
                            tensors.read_ahead([])
                        load_int4_module(shell, tensors, self.device, self.dtype, name=path, profile=self.profile)
                        self._keep_module(shell_unit[path], shell)
                    got[C.unit_of(path + ".")] += _module_bytes(shell)
        missing = self.skeleton.missing(units)
        if missing:
            raise ModelError(f"the checkpoint lacks {len(missing)} tensor(s) of {component}, e.g. {missing[0]}; "
                             "re-run orin-omni quantize")
        written = 0
        if packed is not None:  # what was converted is kept, for the next load
            for unit in sorted({shell_unit[p] for p in shells}, key=C.unit_sort_key):
                modules = {p: m for p, m in shells.items() if shell_unit[p] == unit}
                written += bool(packed.store(unit, files, modules))
        return got, from_packed, written

    def _load_all_packed(self, packed: PackedCache, units: list[str], files: list, shells: dict,
                         got: dict[str, int]) -> int:
        """The units that have a valid packed copy, loaded from it one after the other, each unit's last read
        reading the next one's first batch ahead (a talker load is 20 units of ~80 MB: each first read waiting on
        the disk alone was two fifths of the load). How many were loaded so."""
        found = [(unit, hit) for unit in units if (hit := packed.find(unit, files)) is not None]
        readers = [self._blocks(hit.path) for _, hit in found]
        stage = self._batch_bytes()
        batches = [_name_batches(blocks, hit.names, stage) for blocks, (_, hit) in zip(readers, found, strict=True)]
        loaded = 0
        try:
            for i, (unit, hit) in enumerate(found):
                after = (readers[i + 1], batches[i + 1][0]) if i + 1 < len(found) and batches[i + 1] else None
                loaded += self._load_packed(unit, hit, shells, got, readers[i], batches[i], after)
        finally:
            for blocks in readers:  # a read ahead that no load took (a copy refused, or an error)
                blocks.drop_ahead()
        return loaded

    def _load_packed(self, unit: str, hit, shells: dict, got: dict[str, int], blocks: BlockReader,
                     batches: list[list[str]], after: tuple[BlockReader, list[str]] | None) -> bool:
        """Fill the unit's INT4 modules from their packed copy: its tensors read in batches (the next read
        meanwhile: this unit's next batch, or `after`'s names from its reader), taken as the modules' buffers
        without a copy. False where the copy does not fit the modules (then they stay empty, to be converted)."""
        mine = {p for p in shells if self.skeleton.shell_unit[p] == unit}
        if set(hit.buffers) != mine:
            log.warning("%s: the packed copy holds other modules than %s has; converting it", hit.path, unit)
            blocks.drop_ahead()  # its first batch, read ahead into a staging buffer the next unit's reads take
            return False
        # read straight into the unit's arena (no copy), where it has one
        alloc = None if self._arenas is None else self._arenas.of(unit).take
        tensors: dict = {}
        for i, batch in enumerate(batches):
            if i + 1 < len(batches):
                then, then_in = batches[i + 1], None
            else:
                then_in, then = after or (None, None)
            with GATE:
                tensors.update(blocks.read(batch, max_gap=0, then=then, alloc=alloc, then_in=then_in))
        try:
            for path, names in hit.buffers.items():
                shells[path].load_packed_({b: tensors[n] for b, n in names.items()}, hit.meta[path], self.device,
                                          name=path, profile=self.profile)
                self._keep_module(unit, shells[path])  # a tensor the reader had to copy (misaligned)
        except (ModelError, KeyError) as exc:
            log.warning("%s: %s; converting %s from the checkpoint", hit.path, exc, unit)
            for path in mine:
                shells[path].unload_()
            return False
        got[unit] += sum(_module_bytes(shells[p]) for p in mine)
        return True


def _assemble(key: str, file_keys: list[str], parts: list[torch.Tensor]) -> torch.Tensor:
    """One runtime parameter from its file tensors: the tensor itself, or a fused experts tensor stacked from
    one weight per expert as the hub stores them (gate_up_proj [E, 2I, H]: each expert's gate rows, then up)."""
    if len(parts) == 1 and expert_part(to_runtime(file_keys[0])) is None:
        return parts[0]
    if key.endswith(".gate_up_proj"):
        if len(parts) % 2:
            raise ModelError(f"{key}: the checkpoint has an expert's gate_proj without its up_proj")
        return torch.stack([torch.cat(parts[i:i + 2], dim=0) for i in range(0, len(parts), 2)])
    return torch.stack(parts)


def _plain_batches(blocks: BlockReader, plain: list[tuple[str, list[str]]],
                   limit: int) -> list[list[tuple[str, list[str]]]]:
    """The plain tensors unit by unit, in file order, in batches of about `limit` bytes (a staging buffer's worth:
    one read and one device copy per batch, the next batch read meanwhile; a batch is also the longest a capture or
    a prefill waits for the loading thread, orin.device.gate). A batch never spans two units: its tensors are views
    of one device block, which lives until the last of them goes."""
    def order(item):
        return C.unit_sort_key(C.unit_of(item[0])), min(blocks.index[k][2] for k in item[1])

    def size(item):
        return sum(blocks.index[k][3] - blocks.index[k][2] for k in item[1])

    batches: list[list] = []
    held, unit = 0, None
    for item in sorted(plain, key=order):
        if not batches or held + size(item) > limit or C.unit_of(item[0]) != unit:
            batches.append([])
            held, unit = 0, C.unit_of(item[0])
        batches[-1].append(item)
        held += size(item)
    return batches


def _name_batches(blocks: BlockReader, names, limit: int) -> list[list[str]]:
    """Consecutive tensors of one file (in file order) in batches of about `limit` bytes, a larger one alone."""
    batches: list[list[str]] = []
    held = 0
    for name in names:
        size = blocks.index[name][3] - blocks.index[name][2]
        if not batches or held + size > limit:
            batches.append([])
            held = 0
        batches[-1].append(name)
        held += size
    return batches


def _first_read(shells: dict, module, profile: DeviceProfile) -> list[str]:
    """The file keys an INT4 module's load reads first: all of a Linear's, an experts module's first batch (its
    size the profile's, as the load's)."""
    from ..int4.linear import Int4Experts

    path, int4 = module
    shell = shells[path]
    if isinstance(shell, Int4Experts):
        return [f"{int4.file_prefix}.{k}" for k in shell.first_read_keys(profile)]
    return list(int4.keys)


def _module_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers() if b is not None)


class _LazyReader:
    """A source's safetensors reader, opened on the first tensor asked for: opening one takes 60-140 ms on the
    real checkpoint (its header, every tensor of the file), and a load from packed copies or of plain tensors
    alone (read in blocks) asks for none."""

    def __init__(self, source, device: torch.device):
        self._source, self._device = source, device
        self._stack = contextlib.ExitStack()
        self._reader = None

    def get_tensor(self, key: str) -> torch.Tensor:
        if self._reader is None:
            self._reader = self._stack.enter_context(self._source.open(self._device))
        return self._reader.get_tensor(key)

    def __enter__(self) -> _LazyReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class _Relative(Mapping):
    """A lazy view of one INT4 module's checkpoint tensors, with keys relative to the module path; tensors are
    read from the open safetensors file only when the module asks for them, one at a time or, announced with
    `read_block`, many in one read (orin.memory.block_reader)."""

    def __init__(self, reader, path: str, keys: list[str], blocks=None, then: list[str] = ()):
        self._reader = reader
        self._blocks = blocks
        self._then = then
        self._prefix = path + "."
        self._keys = dict.fromkeys(k[len(self._prefix):] for k in keys)  # ordered, and O(1) to look up
        self._ready: dict[str, torch.Tensor] = {}

    def read_block(self, keys) -> None:
        """Read these keys (those the module has) together; each is handed out once, then dropped here."""
        if self._blocks is not None:
            wanted = [self._prefix + k for k in keys if k in self._keys]
            n = len(self._prefix)
            self._ready.update((name[n:], t) for name, t in self._blocks.read(wanted).items())

    def read_ahead(self, keys) -> None:
        """Start reading these keys in the background; a later `read_block` of the same keys picks them up. With
        no keys (the module has read all it needs), the next module's first read (`then`, file keys) instead."""
        if self._blocks is not None:
            names = [self._prefix + k for k in keys if k in self._keys] if keys else list(self._then)
            if names:
                self._blocks.read_ahead(names)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        ready = self._ready.pop(key, None)
        return ready if ready is not None else self._reader.get_tensor(self._prefix + key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
