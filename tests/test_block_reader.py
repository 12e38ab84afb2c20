"""orin.memory.block_reader: many tensors of a safetensors file in one read give exactly what safetensors reads one at a
time (misaligned offsets, runs split at gaps, on the loader's device), and a truncated file is named."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from orin.device.profile import MemoryTuning
from orin.errors import ModelError
from orin.memory.block_reader import BlockReader, tensor_index

MAX_GAP = MemoryTuning().max_read_gap


@pytest.fixture()
def checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.odd": torch.randint(0, 255, (3,), generator=gen, dtype=torch.int64).to(torch.uint8),  # 3 bytes: misaligns
        "b.qweight": torch.randint(-2**31, 2**31 - 1, (16, 8), generator=gen, dtype=torch.int32),
        "c.scales": torch.randn(3, 5, generator=gen).to(torch.float16),
        "d.big": torch.zeros((MAX_GAP // 2 + 17,), dtype=torch.float32),  # a gap wider than MAX_GAP for e's run
        "e.weight": torch.randn(4, 6, generator=gen).to(torch.bfloat16),
        "f.flag": torch.tensor([True, False, True]),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_block_reads_equal_safetensors_reads(checkpoint):
    path, tensors = checkpoint
    names = ["a.odd", "b.qweight", "c.scales", "e.weight", "f.flag"]  # d.big skipped: e is read in a run of its own
    got = BlockReader(path, torch.device("cpu")).read(names)
    with safe_open(str(path), framework="pt") as f:
        for name in names:
            want = f.get_tensor(name)
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    base, index = tensor_index(str(path))
    assert base > 8 and set(index) == set(tensors)


def test_truncated_file_and_unknown_tensor_are_named(checkpoint):
    path, _ = checkpoint
    reader = BlockReader(path, torch.device("cpu"))
    with pytest.raises(ModelError, match="has no tensor 'z.missing'"):
        reader.read(["z.missing"])
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ModelError, match="truncated"):
        BlockReader(path, torch.device("cpu")).read(["f.flag"])


def test_read_ahead_then_read_gives_the_same_tensors(checkpoint):
    path, tensors = checkpoint
    reader = BlockReader(path, torch.device("cpu"))
    reader.read_ahead(["b.qweight", "c.scales"])
    got = reader.read(["b.qweight", "c.scales"])  # picks up the background read
    assert torch.equal(got["b.qweight"], tensors["b.qweight"]) and torch.equal(got["c.scales"], tensors["c.scales"])
    reader.read_ahead(["e.weight"])
    other = reader.read(["a.odd"])  # another read waits for the one in flight, then reads its own
    assert torch.equal(other["a.odd"], tensors["a.odd"])
    assert torch.equal(reader.read(["e.weight"])["e.weight"], tensors["e.weight"])


def test_the_loader_reads_everything_but_its_first_block_ahead(quantized_dir, monkeypatch):
    """Loading a component: its plain tensors come in batches, one read each, and every read but the very first
    (plain batches and each INT4 module's first read) was started in the background while the batch or module
    before it was assigned or converted (none is read twice: an unused read-ahead would be)."""
    from orin.checkpoint.reader import Checkpoint
    from orin.memory.block_reader import BlockReader as Reader
    from orin.memory.loader import Loader

    served, direct, plain = [], [], []
    read = Reader.read

    def spy(self, names, max_gap=None, then=None, alloc=None, then_in=None):
        kw = {} if max_gap is None else {"max_gap": max_gap}
        hit = self._ahead is not None and self._ahead[0] == frozenset(names)
        (served if hit else direct).append(len(names))
        if max_gap == 0:
            plain.append(names)
        return read(self, names, then=then, alloc=alloc, then_in=then_in, **kw)

    monkeypatch.setattr(Reader, "read", spy)
    ckpt = Checkpoint.open(quantized_dir)
    loader = Loader(ckpt, torch.device("cpu"), torch.float32)
    try:
        loader.ensure("thinker_text")
    finally:
        loader.close()
    modules = [m for m in ckpt.quantized_modules if m.startswith("thinker.model.language_model.")]
    plain_keys = [k for src in ckpt.sources("thinker_text") for fks in src.plain.values() for k in fks]
    assert sorted(k for names in plain for k in names) == sorted(plain_keys)
    # a batch per unit at least (the rest, each layer), fewer reads than tensors
    assert len(loader.units("thinker_text")) <= len(plain) < len(plain_keys)
    assert len(modules) > 2 and len(direct) == 1 and len(served) >= len(modules) + len(plain) - 1


def test_a_read_can_read_ahead_in_another_file_and_an_unused_read_ahead_is_dropped(checkpoint, tmp_path):
    """The next unit's first batch is read ahead from its own file while this unit's last copy runs; a read-ahead
    that no read takes is waited for and forgotten (its staging buffer must not be filled under a later read)."""
    path, tensors = checkpoint
    other_path = tmp_path / "n.safetensors"
    more = {"g.weight": torch.arange(12, dtype=torch.int32).view(3, 4)}
    save_file(more, str(other_path))
    reader, other = BlockReader(path, torch.device("cpu")), BlockReader(other_path, torch.device("cpu"))
    got = reader.read(["b.qweight"], then=["g.weight"], then_in=other)
    assert reader._ahead is None and other._ahead is not None and other._ahead[0] == frozenset(["g.weight"])
    assert torch.equal(got["b.qweight"], tensors["b.qweight"])
    assert torch.equal(other.read(["g.weight"])["g.weight"], more["g.weight"]) and other._ahead is None
    other.read_ahead(["g.weight"])
    future = other._ahead[3]
    other.drop_ahead()
    assert other._ahead is None and future.done()
    other.drop_ahead()  # nothing to drop


def test_spans_larger_than_a_staging_buffer_and_reads_ahead_while_copying(checkpoint):
    """A span over a staging buffer's bytes is read piece by piece through the two staging buffers; `then` starts
    the next read before this one's copy is waited for: the tensors are the same."""
    path, tensors = checkpoint
    # b.qweight alone is 512 bytes: 13 pieces
    reader = BlockReader(path, torch.device("cpu"), MemoryTuning(stage_bytes=40))
    got = reader.read(["b.qweight", "c.scales"], then=["e.weight"])
    assert torch.equal(got["b.qweight"], tensors["b.qweight"]) and torch.equal(got["c.scales"], tensors["c.scales"])
    assert reader._ahead is None  # e.weight's 48 bytes exceed the buffer: read when asked, not ahead
    assert torch.equal(reader.read(["e.weight"])["e.weight"], tensors["e.weight"])
    reader = BlockReader(path, torch.device("cpu"), MemoryTuning(stage_bytes=64 << 20))
    reader.read(["a.odd"], then=["e.weight"])
    assert reader._ahead is not None and reader._ahead[0] == frozenset(["e.weight"])
    assert torch.equal(reader.read(["e.weight"])["e.weight"], tensors["e.weight"])


def test_a_span_read_in_parallel_pieces_is_the_same_and_a_short_file_named(checkpoint):
    path, tensors = checkpoint
    pieces = MemoryTuning(read_piece=4000)  # every span in many odd-sized pieces, on the reading threads
    got = BlockReader(path, torch.device("cpu"), pieces).read(list(tensors))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    path.write_bytes(path.read_bytes()[:-300])
    with pytest.raises(ModelError, match="truncated"):
        BlockReader(path, torch.device("cpu"), pieces).read(list(tensors))
