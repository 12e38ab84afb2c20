"""Atomic writes publish what a plain open()/mkdir() would under the umask: the service user must be able to read
a checkpoint written by `orin-omni quantize`, whatever the writers inside (safetensors makes 0600 files)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orin.fsutil import atomic_dir, atomic_path, atomic_write_json, current_umask


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def save_safetensors(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 2)}, str(path))


def test_current_umask_reads_without_changing_it(umask):
    assert current_umask() == umask
    assert os.umask(umask) == umask


def test_safetensors_alone_makes_owner_only_files(tmp_path, umask):
    """Why atomic_dir and atomic_path set modes at all: save_file ignores the umask."""
    save_safetensors(tmp_path / "w.safetensors")
    assert mode(tmp_path / "w.safetensors") == 0o600


def test_atomic_dir_publishes_files_and_directories_under_the_umask(tmp_path, umask):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        save_safetensors(tmp / "model.safetensors")
        (tmp / "sub").mkdir(mode=0o700)
        save_safetensors(tmp / "sub" / "model.safetensors")
        with open(tmp / "sub" / "config.json", "w") as fh:
            fh.write("{}\n")
        fd = os.open(tmp / "secretive.json", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        atomic_write_json(tmp / "quantize_config.json", {"bits": 4})
        (tmp / "alias.safetensors").symlink_to("model.safetensors")
    assert mode(target) == 0o777 & ~umask
    assert mode(target / "sub") == 0o777 & ~umask
    for name in ("model.safetensors", "sub/model.safetensors", "sub/config.json", "secretive.json",
                 "quantize_config.json"):
        assert mode(target / name) == 0o666 & ~umask, name
    assert (target / "alias.safetensors").is_symlink()
    assert not list(tmp_path.glob(".ckpt.*"))


def test_atomic_dir_keeps_an_executable_executable(tmp_path, umask):
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        (tmp / "run.sh").chmod(0o700)
    assert mode(tmp_path / "d" / "run.sh") == 0o777 & ~umask


def test_atomic_path_publishes_under_the_umask_even_when_the_writer_replaces_the_file(tmp_path, umask):
    with atomic_path(tmp_path / "plain.json") as tmp:
        tmp.write_text("{}\n")
    with atomic_path(tmp_path / "w.safetensors") as tmp:
        save_safetensors(tmp)  # a new inode, 0600, in place of mkstemp's file
    assert mode(tmp_path / "plain.json") == 0o666 & ~umask
    assert mode(tmp_path / "w.safetensors") == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.json", "w.safetensors"]


def test_atomic_path_explicit_mode_wins_over_the_umask(tmp_path, umask):
    with atomic_path(tmp_path / "unit.service", mode=0o644) as tmp:
        tmp.write_text("[Unit]\n")
    assert mode(tmp_path / "unit.service") == 0o644


def test_atomic_path_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "x.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def published(root: Path) -> dict[str, int]:
    """Every path under root whose mode is not what the umask gives a plain file or directory."""
    umask = current_umask()
    wrong = {}
    for path in (root, *root.rglob("*")):
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        if not path.is_symlink() and mode(path) != want:
            wrong[str(path.relative_to(root))] = oct(mode(path))
    return wrong


def test_tiny_model_is_readable_by_others(tiny_model_dir):
    assert published(Path(tiny_model_dir)) == {}


def test_quantized_checkpoint_is_readable_by_others(quantized_dir):
    """Segments, manifest, report and shared files: what the service user has to read."""
    root = Path(quantized_dir)
    names = {str(p.relative_to(root)) for p in root.rglob("*")}
    assert {"model-00001-of-00002.safetensors", "model.safetensors.index.json", "manifest.json", "report.json",
            "config.json"} <= names
    assert published(root) == {}
