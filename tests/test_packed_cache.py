"""The packed copy (orin.memory.packed_cache): INT4 units kept in the device's kernel layout after their first load. On
the tiny INT4 model on CPU (the CPU's int4pack layout: the same code path as CUDA's, another layout): a load from
the packed copies gives the very buffers the conversion gives and the same generation, without converting; a
copy made for another torch, device, code or checkpoint file is not used but rebuilt; a damaged one (flipped
byte, truncated, garbage header) is deleted and rebuilt, never loaded; a directory that cannot be written costs
the speed-up only; a write that fails leaves no file behind."""

from __future__ import annotations

import json
import logging
import shutil
import struct

import pytest
import torch

from orin import components as C
from orin.contract import Done, GenerationRequest
from orin.inputs.media import synth_image, synth_speechlike
from orin.int4 import pack as int4pack
from orin.memory import packed_cache as P
from orin.runtime.engine import Engine, EngineConfig

# every component: image and audio in, speech out
REQ = GenerationRequest(messages=({"role": "user", "content": [
    {"type": "image", "image": synth_image(96, seed=3)},
    {"type": "audio", "audio": synth_speechlike(1.5, seed=4)},
    {"type": "text", "text": "What is this?"}]},), max_new_tokens=4, max_audio_frames=6, ignore_eos=True)


def _engine(model_dir, cache=None, budget=None):
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", power_backend="none", verify_checksums=False,
                               packed_cache=None if cache is None else str(cache), budget=budget))


def _run(engine):
    events = list(engine.stream(REQ))
    report = next(e.report for e in events if isinstance(e, Done))
    return report, (report.token_ids, tuple(f for e in events for f in getattr(e, "frames", ())))


def _served(model_dir, cache):
    """One request through a fresh engine (which loads every unit, all-resident): its report."""
    eng = _engine(model_dir, cache)
    try:
        return _run(eng)[0]
    finally:
        eng.close()


def _buffers(engine):
    out = {}
    for path, shell in engine.loader.shells.items():
        tensors, meta = shell.packed_state()
        out[path] = ({k: t.clone() for k, t in tensors.items()}, meta)
    return out


def _int4_units(engine):
    return sorted({C.unit_of(p + ".") for p in engine.loader.shells}, key=C.unit_sort_key)


@pytest.fixture(scope="module")
def reference(quantized_dir):
    """The conversion's buffers and an all-resident generation, without a cache."""
    eng = _engine(quantized_dir)
    try:
        outcome = _run(eng)[1]  # all-resident: every unit is loaded after it
        return _buffers(eng), outcome
    finally:
        eng.close()


def _no_conversion(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("converted although a valid packed copy exists")

    monkeypatch.setattr(int4pack, "to_kernel", refuse)
    monkeypatch.setattr("orin.int4.linear.to_kernel", refuse)
    monkeypatch.setattr("orin.int4.experts.to_kernel", refuse)


def test_first_load_writes_copies_and_later_loads_read_them(quantized_dir, tmp_path, reference, monkeypatch):
    buffers, outcome = reference
    cache = tmp_path / "cache"
    first = _engine(quantized_dir, cache)
    try:
        report, got_outcome = _run(first)
        assert got_outcome == outcome
        units = _int4_units(first)
        assert sorted(p.name for p in cache.iterdir()) == sorted(u.replace("/", ".") + ".safetensors" for u in units)
        written = sum(s.written for s in report.swaps if s.direction == "in")
        assert written == len(units)
    finally:
        first.close()
    _no_conversion(monkeypatch)
    second = _engine(quantized_dir, cache)
    try:
        report, got_outcome = _run(second)
        assert got_outcome == outcome
        swaps = report.swaps
        assert sum(s.packed for s in swaps) == len(units) and sum(s.written for s in swaps) == 0
        got = _buffers(second)
        assert got.keys() == buffers.keys()
        for path, (tensors, meta) in buffers.items():
            assert got[path][1] == meta, path
            for name, t in tensors.items():
                assert torch.equal(got[path][0][name], t), f"{path}.{name}"
    finally:
        second.close()


def test_time_sliced_loads_read_the_copies(quantized_dir, tmp_path, reference, monkeypatch):
    """Under a budget the thinker's layers move on every request: after the first, they come from the copies."""
    outcome = reference[1]
    probe = _engine(quantized_dir, tmp_path / "cache")
    try:
        _run(probe)  # writes the copies
        budget = probe.plan(REQ).verdict.min_budget
    finally:
        probe.close()
    _no_conversion(monkeypatch)
    eng = _engine(quantized_dir, tmp_path / "cache", budget=budget)
    try:
        for _ in range(2):
            report, got = _run(eng)
            assert got == outcome
            moved_in = [s for s in report.swaps if s.direction == "in"]
            assert moved_in and all(s.packed for s in moved_in if s.component in ("thinker_text", "talker"))
    finally:
        eng.close()


def test_packed_units_are_read_ahead_across_their_files(quantized_dir, tmp_path, monkeypatch):
    """Loading a component from its packed copies, one file per unit: every read but the very first was started
    in the background (each unit's last read starts the next unit's first), and none is read twice."""
    from orin.memory.block_reader import BlockReader

    _served(quantized_dir, tmp_path / "cache")  # writes the copies
    reads = []  # (file, whether a read-ahead served it), in order
    read = BlockReader.read

    def spy(self, names, *args, **kwargs):
        reads.append((self.path, self._ahead is not None and self._ahead[0] == frozenset(names)))
        return read(self, names, *args, **kwargs)

    eng = _engine(quantized_dir, tmp_path / "cache", budget=1 << 40)
    monkeypatch.setattr(BlockReader, "read", spy)
    try:
        eng.loader.ensure("thinker_text")
        copies = [s for s in eng.loader.take_swaps() if s.direction == "in"]
        assert copies and copies[-1].packed >= 2
        from_copies = [(p, ahead) for p, ahead in reads if p.startswith(str(tmp_path / "cache"))]
        assert len({p for p, _ in from_copies}) == copies[-1].packed
        assert [ahead for _, ahead in from_copies] == [False] + [True] * (len(from_copies) - 1)
    finally:
        eng.close()


def test_a_refused_copy_drops_its_read_ahead_at_once(quantized_dir, tmp_path, reference, monkeypatch):
    """A packed copy that lists other modules than its unit has is refused and the unit converted. The first
    batch the unit before it read ahead is waited for and dropped as the copy is refused, not after the units
    that follow: their reads take the staging buffer it was filling. The unit's buffers are the conversion's."""
    import dataclasses

    from orin.memory.unit_reader import UnitReader

    buffers, _ = reference
    _served(quantized_dir, tmp_path / "cache")  # writes the copies
    find = P.PackedCache.find

    def refuse_second(self, unit, files):
        hit = find(self, unit, files)
        if hit is not None and unit.endswith("/1"):
            return dataclasses.replace(hit, buffers={**hit.buffers, "no.such.module": {}})
        return hit

    refused = []
    load_packed = UnitReader._load_packed

    def spy(self, unit, hit, shells, got, blocks, batches, after):
        ahead = blocks._ahead is not None
        ok = load_packed(self, unit, hit, shells, got, blocks, batches, after)
        if not ok:
            refused.append((unit, ahead, blocks._ahead is None))
        return ok

    monkeypatch.setattr(P.PackedCache, "find", refuse_second)
    monkeypatch.setattr(UnitReader, "_load_packed", spy)
    eng = _engine(quantized_dir, tmp_path / "cache", budget=1 << 40)
    try:
        eng.loader.ensure("thinker_text")
        assert refused == [("thinker_text/1", True, True)]
        layer = "thinker.model.language_model.layers.1."
        for path, (tensors, _) in buffers.items():
            if path.startswith(layer):
                got = eng.loader.shells[path].packed_state()[0]
                for name, t in tensors.items():
                    assert torch.equal(got[name], t), f"{path}.{name}"
    finally:
        eng.close()


@pytest.mark.parametrize("change", ["torch", "code", "checkpoint"])
def test_a_copy_for_another_layout_or_checkpoint_is_rebuilt(quantized_dir, tmp_path, change, monkeypatch):
    cache = tmp_path / "cache"
    _served(quantized_dir, cache)
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    model = tmp_path / "model"
    if change == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    elif change == "code":
        real = P._code_digest
        monkeypatch.setattr(P, "_code_digest", lambda: real()[::-1])
    model_dir = quantized_dir
    if change == "checkpoint":  # the thinker segment re-quantized: its file's recorded sha256 differs
        shutil.copytree(quantized_dir, model)
        manifest = json.loads((model / "manifest.json").read_text())
        manifest["segments"]["thinker"]["files"][0]["sha256"] = "f" * 64
        (model / "manifest.json").write_text(json.dumps(manifest))
        model_dir = str(model)
    eng = _engine(model_dir, cache)
    try:
        swaps = _run(eng)[0].swaps
        rebuilt = {p.name for p in cache.iterdir() if p.stat().st_mtime_ns != stamps[p.name]}
        if change == "checkpoint":  # only the thinker segment's units
            assert rebuilt and all(n.startswith("thinker_text.") for n in rebuilt), rebuilt
        else:
            assert rebuilt == set(stamps)
        assert sum(s.written for s in swaps) == len(rebuilt)
    finally:
        eng.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_copy_is_deleted_and_rebuilt_never_loaded(quantized_dir, tmp_path, reference, damage, caplog):
    cache = tmp_path / "cache"
    _served(quantized_dir, cache)
    victim = cache / "thinker_text.0.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data[8:20] = b"not json at!"
    victim.write_bytes(bytes(data))
    eng = _engine(quantized_dir, cache)
    try:
        with caplog.at_level(logging.WARNING, logger="orin.memory.packed_cache"):
            report, outcome = _run(eng)
        assert "damaged" in caplog.text and "thinker_text.0" in caplog.text
        assert sum(s.written for s in report.swaps) == 1
        assert outcome == reference[1]
    finally:
        eng.close()
    # the rebuilt copy is sound: a fresh process reads it without warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="orin.memory.packed_cache"):
        _served(quantized_dir, cache)
    assert "damaged" not in caplog.text


def test_an_unwritable_directory_costs_only_the_speed_up(quantized_dir, tmp_path, reference, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    eng = _engine(quantized_dir, blocker / "cache")
    try:
        with caplog.at_level(logging.WARNING, logger="orin.memory.packed_cache"):
            outcome = _run(eng)[1]
        assert caplog.text.count("cannot write packed copies") == 1
        assert outcome == reference[1]
    finally:
        eng.close()


def test_a_disk_short_of_the_margin_gets_no_copies(quantized_dir, tmp_path, reference, monkeypatch, caplog):
    """A copy never takes the last DISK_MARGIN bytes of the disk the system runs from: the model is served,
    converted on every load, and the warning says how much is free and needed."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr(P, "DISK_MARGIN", shutil.disk_usage(cache).total)
    eng = _engine(quantized_dir, cache)
    try:
        with caplog.at_level(logging.WARNING, logger="orin.memory.packed_cache"):
            outcome = _run(eng)[1]
    finally:
        eng.close()
    assert caplog.text.count("MiB needed") == 1
    assert outcome == reference[1]
    assert list(cache.iterdir()) == []


def test_a_failed_write_leaves_nothing_behind(quantized_dir, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    calls = []
    real = P._with_digest

    def fail_once(header, digest):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(header, digest)

    monkeypatch.setattr(P, "_with_digest", fail_once)
    with caplog.at_level(logging.WARNING, logger="orin.memory.packed_cache"):
        _served(quantized_dir, cache)
    assert "No space left" in caplog.text
    names = [p.name for p in cache.iterdir()]
    assert len(names) == 1 and not any(n.endswith(".tmp") for n in names)  # the first, whole; nothing after


def test_file_layout_is_aligned_safetensors(quantized_dir, tmp_path):
    from safetensors import safe_open

    cache = tmp_path / "cache"
    _served(quantized_dir, cache)
    for path in cache.iterdir():
        (length,) = struct.unpack("<Q", path.read_bytes()[:8])
        assert (8 + length) % P.ALIGN == 0
        header = json.loads(path.read_bytes()[8:8 + length])
        for name, info in header.items():
            if name != "__metadata__":
                assert info["data_offsets"][0] % P.ALIGN == 0 or name.startswith("__pad__"), name
        with safe_open(str(path), framework="pt") as f:  # the reference reader takes it
            assert len(list(f.keys())) == len(header) - 1


def test_the_option_names_a_directory_or_none(tmp_path):
    assert P.resolve_dir("off", str(tmp_path)) is None
    assert P.resolve_dir("auto", str(tmp_path)) == str(tmp_path / "packed-cache")
    assert P.resolve_dir(None, str(tmp_path)) == str(tmp_path / "packed-cache")
    assert P.resolve_dir("/var/cache/q/packed", str(tmp_path)) == "/var/cache/q/packed"
    assert P.resolve_dir("auto", None) is None  # smoke against a URL: no model directory here
