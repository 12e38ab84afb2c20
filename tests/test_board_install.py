"""The board's install, checked on every CI run (issue 37, item 9): the device-side extras (runtime, serve, jetson)
resolve for Linux aarch64 on Python 3.10 (JetPack 6) and 3.12 (JetPack 7.2) from binary wheels alone, so a
dependency without a wheel for the board fails here instead of in a user's first `pip install` on it.

pip resolves for the board without installing anything: `--dry-run` with `--platform`, `--python-version`,
`--implementation` and `--only-binary=:all:` (pip needs `--target` with `--platform`; `--ignore-installed` keeps
this venv's packages out of it). torch is the board's own (the JetPack's source, docs/jetson.md): it is dropped
from the requirements, and what asks for it (silero-vad does) gets a stub wheel of the board's version instead of
one of PyPI's, which would mean gigabytes of downloads and backtracking, and which the board never installs.

pip evaluates environment markers for the interpreter running it, not the target (pip's `--python-version` sets
only wheel tags and Requires-Python), so the markers of orin-omni's own requirements (numpy's depend on
python_version and platform_machine) are evaluated here for the board, and the requirements passed without them.
The markers of dependencies' dependencies are still pip's, for this interpreter: they select pure-Python
backports, whose wheels fit any board.

Needs the package index (CI has it); pip's cache keeps a rerun to seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # the main suite's Python (>= 3.11); the compat one does not run this

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "orin-omni"
EXTRAS = ("runtime", "serve", "jetson")
PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "linux_aarch64")
# The board's Python, with the torch it already has: JetPack 6's Jetson AI Lab build, JetPack 7.2's PyPI one.
BOARDS = {"3.10": "2.8.0", "3.12": "2.11.0"}
# What the board's own torch brings: the dry run on the board must name none of them (docs/jetson.md). NVML's
# Python bindings (nvidia-ml-py, the serve extra's) are no part of torch's CUDA stack.
BOARD_OWN = re.compile(r"^(torch|triton|nvidia-(?!ml-py$).*|cuda-.*)$")
PIP_TIMEOUT_S = 900


def board_environment(python: str) -> dict[str, str]:
    """The marker environment of a Jetson running CPython `python` (PEP 508 names)."""
    return {"python_version": python, "python_full_version": f"{python}.0", "platform_machine": "aarch64",
            "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def board_requirements(pyproject: dict, python: str, extras=EXTRAS) -> list[str]:
    """orin-omni's base requirements and those of `extras` (self-references such as orin-omni[runtime] followed),
    whose markers hold on the board, without their markers and without torch."""
    project = pyproject["project"]
    env = board_environment(python)
    out: list[str] = []
    seen_extras: set[str] = set()

    def add(lines):
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if canonicalize_name(req.name) == PROJECT:
                for extra in sorted(req.extras - seen_extras):
                    seen_extras.add(extra)
                    add(project["optional-dependencies"][extra])
                continue
            if canonicalize_name(req.name) == "torch":
                continue
            req.marker = None
            text = str(req)
            if text not in out:
                out.append(text)

    add(project.get("dependencies", []))
    for extra in extras:
        if extra not in seen_extras:
            seen_extras.add(extra)
            add(project["optional-dependencies"][extra])
    return out


def stub_torch_wheel(folder: Path, version: str) -> str:
    """A wheel named torch at `version` holding nothing: what pip sees of the board's torch. Returns the version
    it carries (a local label, so nothing but this file matches it)."""
    full = f"{version}+board"
    dist_info = f"torch-{full}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {full}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: orin-omni-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist_info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{dist_info}/RECORD"])
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"torch-{full}-py3-none-any.whl", "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    return full


def pip_board_dry_run(requirements: list[str], python: str, torch_version: str, tmp: Path):
    """pip's dry run of `requirements` for the board: (the completed process, the resolved packages by name)."""
    stub = stub_torch_wheel(tmp / "board-torch", torch_version)
    constraints = tmp / "board-constraints.txt"
    constraints.write_text(f"torch=={stub}\n")
    report = tmp / "report.json"
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
            *(f"--platform={p}" for p in PLATFORMS), "--python-version", python, "--implementation", "cp",
            "--target", str(tmp / "target"), "--find-links", str(tmp / "board-torch"), "-c", str(constraints),
            "--report", str(report), "--progress-bar", "off", "--disable-pip-version-check", *requirements]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    resolved = {}
    if proc.returncode == 0:
        for item in json.loads(report.read_text())["install"]:
            resolved[canonicalize_name(item["metadata"]["name"])] = item["metadata"]["version"]
    return proc, resolved


def no_wheel_message(stderr: str) -> str:
    """What pip's failure says, the package without a wheel first."""
    missing = re.findall(r"No matching distribution found for (\S+)", stderr)
    tail = "\n".join(stderr.strip().splitlines()[-15:])
    if missing:
        return f"no binary wheel for the board: {', '.join(missing)}\n{tail}"
    return f"pip could not resolve the board's install:\n{tail}"


def _offline(stderr: str) -> bool:
    return bool(re.search(r"Max retries exceeded|Failed to establish a new connection|Temporary failure in name "
                          r"resolution|Network is unreachable", stderr))


def test_board_requirements_follow_the_markers_and_drop_torch():
    """The requirement list itself: markers evaluated for the board, not for this interpreter."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    jp6 = board_requirements(pyproject, "3.10")
    jp7 = board_requirements(pyproject, "3.12")
    for reqs in (jp6, jp7):
        names = [Requirement(r).name for r in reqs]
        assert "torch" not in names and PROJECT not in names
        assert {"click", "jinja2", "safetensors", "uvicorn", "onnxruntime", "jetson-stats"} <= set(names)
        assert all(Requirement(r).marker is None for r in reqs)
    # numpy's two lines are exclusive by their markers: JetPack 6 (aarch64, 3.10) keeps NumPy 1, 7.2 allows 2.
    numpy = {python: [Requirement(r) for r in reqs if r.startswith("numpy")] for python, reqs in (("3.10", jp6),
                                                                                                  ("3.12", jp7))}
    assert len(numpy["3.10"]) == len(numpy["3.12"]) == 1
    assert not numpy["3.10"][0].specifier.contains("2.0.0") and numpy["3.12"][0].specifier.contains("2.0.0")
    # A self-reference is followed once, whichever extra names it.
    fake = {"project": {"dependencies": [], "optional-dependencies": {
        "a": ["orin-omni[b]", "x>=1; python_version < '3.11'"], "b": ["orin-omni[a]", "y"]}}}
    assert board_requirements(fake, "3.10", ("a",)) == ["y", "x>=1"]
    assert board_requirements(fake, "3.12", ("b",)) == ["y"]


@pytest.mark.parametrize("python", sorted(BOARDS))
def test_device_extras_resolve_for_the_board_from_wheels_only(python, tmp_path):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = board_requirements(pyproject, python)
    started = time.monotonic()
    proc, resolved = pip_board_dry_run(requirements, python, BOARDS[python], tmp_path)
    took = time.monotonic() - started
    if proc.returncode != 0 and _offline(proc.stderr):
        pytest.skip(f"no package index reachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, no_wheel_message(proc.stderr)
    # Every requirement resolved, and nothing of what comes with the board's torch but the stub.
    for req in requirements:
        name = canonicalize_name(Requirement(req).name)
        assert name in resolved and Requirement(req).specifier.contains(resolved[name], prereleases=True), (
            name, resolved.get(name))
    own = {name: v for name, v in resolved.items() if BOARD_OWN.match(name)}
    assert own in ({}, {"torch": f"{BOARDS[python]}+board"}), f"the board's own packages pulled in: {own}"
    print(f"board install, Python {python}: {len(resolved)} packages resolved in {took:.1f} s")


def test_a_package_without_a_board_wheel_is_named(tmp_path):
    """A requirement with no aarch64 wheel (decord has none) fails the dry run, and the message names it."""
    proc, resolved = pip_board_dry_run(["decord>=0.6"], "3.10", BOARDS["3.10"], tmp_path)
    if proc.returncode != 0 and _offline(proc.stderr):
        pytest.skip("no package index reachable")
    assert proc.returncode != 0 and resolved == {}
    assert no_wheel_message(proc.stderr).startswith("no binary wheel for the board: decord>=0.6")
