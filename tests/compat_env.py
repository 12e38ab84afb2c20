"""What the compat environment installs beside torch, read from the installed metadata (run by the Makefile with
the compat environment's Python, 3.10: no tomllib, so pyproject.toml is read through orin-omni's installed metadata).

    python tests/compat_env.py torch-libs     the nvidia-* pins torch's shared libraries load at `import torch`
    python tests/compat_env.py requirements   torch's pure-Python deps, the runtime and serve extras, pytest, openai
    python tests/compat_env.py torch-dependents  the extras' packages that name torch, installed with --no-deps
    python tests/compat_env.py room DIR       DIR's disk has room for the environment (a clear error if not)
    python tests/compat_env.py prune          delete the parts of torch's CUDA libraries a CPU run never loads
    python tests/compat_env.py check VERSION  the environment is what it claims: that torch, no HF/GPTQ/Triton
    python tests/compat_env.py pip ARGS...    pip ARGS, less its resolver's report of what LAZY leaves out

PyPI's x86_64 torch is a CUDA build whose metadata asks for 14 nvidia-* packages and Triton (3.7 GB of downloads
for 2.8.0). On a CPU, `import torch` needs only the libraries its .so files link (DT_NEEDED): libtorch_cpu.so links
cuPTI and the CUDA runtime, libtorch_cuda.so cuBLAS(Lt), cuDNN, cuFFT, cuFile, cuRAND, cuSPARSE(Lt) and NCCL, and
cuSPARSE links nvJitLink: the 11 kept here (2.8.0 fails to import without any, or without cuPTI alone). The ones
left out are loaded lazily, on first use on a GPU: cuSOLVER (libtorch_cuda_linalg.so), NVRTC (CUDA JIT) and NVTX;
Triton only serves torch.compile, which the runtime does not use (it must run without Triton). That saves 0.5 GB of
download and 1.1 GB on disk (5.5 GB left); `check` imports torch, so a torch that links more fails the build, not
the tests.

Of what is kept, a CPU run still never loads cuDNN's sub-libraries (libcudnn.so.9 dlopens them on a GPU's first
cuDNN call), torch's CUDA linear algebra (dlopened on first use), NVBLAS, cuFFTW, cuPTI's profiling helpers or
torch's C++ headers: `prune` deletes them, 1.2 GB, so the environment takes about 4.3 GB (a CI disk ran out at
5.5). The Makefile installs the libraries one at a time, pruning after each, so pip never holds all their wheels
and the unpacked libraries at once."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

# torch's dependencies a CPU run never loads (see the module doc)
LAZY = {"nvidia-cusolver", "nvidia-cuda-nvrtc", "nvidia-nvtx", "triton"}
# What the compat run must not have: it proves the runtime needs none of them.
ABSENT = ("transformers", "gptqmodel", "optimum", "triton")
# Of the test extra, only what the runtime's tests import (the rest serves the quantize side, lint and packaging).
TEST_TOOLS = {"pytest", "openai"}
EXTRAS = ("runtime", "serve")
# Under site-packages: what a CPU run of torch never loads (see the module doc).
NEVER_LOADED = ("nvidia/cudnn/lib/libcudnn_*.so.*", "torch/lib/libtorch_cuda_linalg.so",
                "nvidia/cublas/lib/libnvblas.so.*", "nvidia/cufft/lib/libcufftw.so.*",
                "nvidia/cuda_cupti/lib/libnvperf_*.so", "nvidia/cuda_cupti/lib/libcheckpoint.so",
                "nvidia/cuda_cupti/lib/libpcsamplingutil.so", "torch/include")
# The pruned environment (4.3 GB) plus the largest download in flight and its unpacking (torch: 0.9 + 1.7 GB).
ROOM_BYTES = 5 * 1024**3


def _stem(name: str) -> str:
    """The package without its CUDA suffix (nvidia-cublas-cu12 -> nvidia-cublas), so a torch built on another
    CUDA major is read alike."""
    return re.sub(r"-cu\d+$", "", name.lower().replace("_", "-"))


def _applies(req, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({"extra": extra})


def _plain(req) -> str:
    """`req` without its marker, evaluated already: pip would read `extra == ...` in a requirements file as false."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def _requirement(line: str):
    # packaging is installed into the fresh environment after `room` has run, so it is imported late.
    from packaging.requirements import Requirement

    return Requirement(line)


def torch_requirements() -> tuple[list[str], list[str]]:
    """(the nvidia-* pins `import torch` needs, torch's pure-Python deps) from the installed torch's metadata."""
    libs, pure = [], []
    for line in md.requires("torch") or []:
        req = _requirement(line)
        if not _applies(req) or _stem(req.name) in LAZY:
            continue
        (libs if req.name.lower().startswith("nvidia-") else pure).append(_plain(req))
    return libs, pure


# Packages that name torch as a dependency but use none of torch's own: installed with --no-deps, or pip takes the
# pinned torch into its resolution and installs the parts of its CUDA set this environment leaves out on purpose
# (Triton, cuSOLVER, NVRTC, NVTX). silero-vad ships the VAD's ONNX model; its own code (torch) is never imported.
TORCH_DEPENDENTS = ("silero-vad",)


def project_requirements() -> list[str]:
    """The base dependencies, the runtime and serve extras (self-references followed) and the test tools, torch left
    out: it is installed at the pinned version, and naming it again would make pip resolve its CUDA dependencies."""
    reqs = [_requirement(line) for line in md.requires("orin-omni") or []]
    out, seen, todo = [], set(), ["", *EXTRAS]
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for req in reqs:
            if not _applies(req, extra) or req.name.lower() == "torch":
                continue
            if req.name == "orin-omni":
                todo.extend(sorted(req.extras))
            elif _plain(req) not in out:
                out.append(_plain(req))
    return out + [_plain(r) for r in reqs if r.name in TEST_TOOLS and _applies(r, "test")]


def room(directory: str, need: int = ROOM_BYTES) -> str:
    """Why `directory`'s disk cannot hold the environment (empty when it can)."""
    path = Path(directory).resolve()
    while not path.exists():
        path = path.parent
    free = shutil.disk_usage(path).free
    if free >= need:
        return ""
    return (f"the compat environment needs about {need / 1024**3:.1f} GiB free on the disk of {path}, which has "
            f"{free / 1024**3:.1f} GiB: free some space, or set COMPAT_VENV to a directory on a larger disk")


def prune(site: Path) -> int:
    """Delete what a CPU run of torch never loads under `site`; the bytes freed."""
    freed = 0
    for pattern in NEVER_LOADED:
        for path in site.glob(pattern):
            if path.is_dir():
                freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path)
            else:
                freed += path.stat().st_size
                path.unlink()
    return freed


# pip's report after an install that resolved dependencies (pip 23-26): this header, then one line per conflict.
RESOLVER_HEADER = "ERROR: pip's dependency resolver does not currently take into account all the packages"
CONFLICT = re.compile(r"(\S+) \S+ requires ([A-Za-z0-9._-]+)")


def pip(args: list[str]) -> int:
    """`python -m pip ARGS`, its exit status kept, less the resolver's report that torch lacks what LAZY names (it
    does, on purpose), with one line saying so instead; everything else pip prints shows, other conflicts too."""
    proc = subprocess.Popen([sys.executable, "-m", "pip", *args], stderr=subprocess.PIPE, text=True)
    header, dropped = None, False  # header: None outside a report, "" once shown
    for line in proc.stderr:
        if line.startswith(RESOLVER_HEADER):
            header = line  # shown only above a conflict that is not a LAZY one
            continue
        conflict = CONFLICT.match(line) if header is not None else None
        missing = line.rstrip().endswith(", which is not installed.")
        if conflict and conflict[1] == "torch" and missing and _stem(conflict[2]) in LAZY:
            dropped = True
            continue
        sys.stderr.write((header if conflict else "") + line)
        header = "" if conflict else None
    if dropped:
        print("compat environment: pip reports torch's cuSOLVER, NVRTC, NVTX and Triton as missing; they are left "
              "out on purpose (a CPU run never loads them: tests/compat_env.py), so that report is not shown")
    return proc.wait()


def check(version: str) -> list[str]:
    """What is wrong with this environment as the compat one (empty when it is right)."""
    import torch

    problems = []
    if not torch.__version__.startswith(version):
        problems.append(f"torch {torch.__version__} is installed, not {version}")
    problems += [f"{name} is installed: the compat environment must run without it (pip uninstall {name}; if the "
                 "runtime or serve extra names it, that is the bug)"
                 for name in ABSENT if importlib.util.find_spec(name) is not None]
    x = torch.arange(6.0).reshape(2, 3)
    if (x @ x.T).tolist() != [[5.0, 14.0], [14.0, 50.0]]:
        problems.append("torch computes a wrong matmul on the CPU")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["torch-libs"]:
        print("\n".join(torch_requirements()[0]))
    elif argv[:1] == ["requirements"]:
        reqs = torch_requirements()[1] + project_requirements()
        print("\n".join(r for r in reqs if _requirement(r).name not in TORCH_DEPENDENTS))
    elif argv[:1] == ["torch-dependents"]:
        reqs = project_requirements()
        print("\n".join(r for r in reqs if _requirement(r).name in TORCH_DEPENDENTS))
    elif argv[:1] == ["room"] and len(argv) == 2:
        problem = room(argv[1])
        if problem:
            print(f"compat environment: {problem}", file=sys.stderr)
            return 1
    elif argv[:1] == ["prune"]:
        freed = prune(Path(sysconfig.get_paths()["purelib"]))
        print(f"compat environment: pruned {freed / 1024**2:.0f} MiB that a CPU run never loads")
    elif argv[:1] == ["pip"] and len(argv) > 1:
        return pip(argv[1:])
    elif argv[:1] == ["check"] and len(argv) == 2:
        problems = check(argv[1])
        for problem in problems:
            print(f"compat environment: {problem}", file=sys.stderr)
        return 1 if problems else 0
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
