"""What the compat environment installs beside torch, read from the installed metadata (run by the Makefile with
the compat environment's Python, 3.10: no tomllib, so pyproject.toml is read through orin-omni's installed metadata).

    python tests/compat_env.py torch-libs     the nvidia-* pins torch's shared libraries load at `import torch`
    python tests/compat_env.py requirements   torch's pure-Python deps, the runtime and serve extras, pytest, openai
    python tests/compat_env.py check VERSION  the environment is what it claims: that torch, no HF/GPTQ/Triton

PyPI's x86_64 torch is a CUDA build whose metadata asks for 14 nvidia-* packages and Triton (3.7 GB of downloads
for 2.8.0). On a CPU, `import torch` needs only the libraries its .so files link (DT_NEEDED): libtorch_cpu.so links
cuPTI and the CUDA runtime, libtorch_cuda.so cuBLAS(Lt), cuDNN, cuFFT, cuFile, cuRAND, cuSPARSE(Lt) and NCCL, and
cuSPARSE links nvJitLink: the 11 kept here (2.8.0 fails to import without any, or without cuPTI alone). The ones
left out are loaded lazily, on first use on a GPU: cuSOLVER (libtorch_cuda_linalg.so), NVRTC (CUDA JIT) and NVTX;
Triton only serves torch.compile, which the runtime does not use (it must run without Triton). That saves 0.5 GB of
download and 1.1 GB on disk (5.5 GB left); `check` imports torch, so a torch that links more fails the build, not
the tests."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import sys

from packaging.requirements import Requirement

# torch's dependencies a CPU run never loads (see the module doc)
LAZY = {"nvidia-cusolver", "nvidia-cuda-nvrtc", "nvidia-nvtx", "triton"}
# What the compat run must not have: it proves the runtime needs none of them.
ABSENT = ("transformers", "gptqmodel", "optimum", "triton")
# Of the test extra, only what the runtime's tests import (the rest serves the quantize side, lint and packaging).
TEST_TOOLS = {"pytest", "openai"}
EXTRAS = ("runtime", "serve")


def _stem(name: str) -> str:
    """The package without its CUDA suffix (nvidia-cublas-cu12 -> nvidia-cublas), so a torch built on another
    CUDA major is read alike."""
    return re.sub(r"-cu\d+$", "", name.lower().replace("_", "-"))


def _applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({"extra": extra})


def _plain(req: Requirement) -> str:
    """`req` without its marker, evaluated already: pip would read `extra == ...` in a requirements file as false."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def torch_requirements() -> tuple[list[str], list[str]]:
    """(the nvidia-* pins `import torch` needs, torch's pure-Python deps) from the installed torch's metadata."""
    libs, pure = [], []
    for line in md.requires("torch") or []:
        req = Requirement(line)
        if not _applies(req) or _stem(req.name) in LAZY:
            continue
        (libs if req.name.lower().startswith("nvidia-") else pure).append(_plain(req))
    return libs, pure


def project_requirements() -> list[str]:
    """The base dependencies, the runtime and serve extras (self-references followed) and the test tools, torch left
    out: it is installed at the pinned version, and naming it again would make pip resolve its CUDA dependencies."""
    reqs = [Requirement(line) for line in md.requires("orin-omni") or []]
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
        print("\n".join(torch_requirements()[1] + project_requirements()))
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
