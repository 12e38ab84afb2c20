"""The checks behind `orin-omni doctor`, one small function each. Every check returns a `Check` (pass, warn, fail
or skip) and never raises for what it finds: a failure or a warning carries its fix, the exact command or action.
torch is imported inside the checks that need it, so a board without torch still gets a report (saying how to
install it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import OrinError
from ..memory.oom import read_meminfo as _read_meminfo
from ..service.unit import size_text
from ..units import format_bytes
from .check import FAIL, PASS, SKIP, Check

# The doctor's fourth status: it works, but something named is known to go wrong on this board (the fix says what
# to do, or that nothing is needed now). No failure: `doctor` still exits 0.
WARN = "warn"

# What orin-omni supports: Python 3.10 (JetPack 6) to 3.13, torch from 2.8 (the INT4 MoE prefill falls back to
# torch._grouped_mm, which 2.8 brought). Bounds are inclusive (major, minor); None = no upper bound.
SUPPORTED = {"python": ((3, 10), (3, 13)), "torch": ((2, 8), None)}
TORCH_INSTALL = {
    "jetpack6": "pip install torch==2.8.0 triton==3.4.0 --index-url https://pypi.jetson-ai-lab.io/jp6/cu126  (JetPack 6: Jetson AI Lab)",
    "jetpack7": "pip install torch  (JetPack 7.2: the CUDA wheels are on PyPI)",
}
MIN_CAPABILITY = (8, 0)  # torch's CUDA INT4 kernel (tinygemm) needs sm_80; the AGX Orin is sm_87
# The INT4 kernel check: a random GPTQ layer through Int4Linear against the dequantized weight in float32. bf16
# activations and bf16 scale/zero pairs keep the relative error below 0.5 %; a wrong layout gives ~100 %.
INT4_SHAPE = (4, 256, 64, 128)  # rows, in_features, out_features, group size
INT4_TOLERANCE = 0.02
# Room the service needs beside its checkpoint: journal, Triton and Inductor compile caches.
DISK_MIN_FREE = 1 << 30
PTXAS_FIX = ("export TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas (Triton's own ptxas may not know the GPU); "
             "for the service, add that line without 'export' to /etc/orin-omni/{name}.env")
Runner = Callable[..., subprocess.CompletedProcess]


def _version(text: str) -> tuple[int, ...]:
    """'2.13.0+cu130' -> (2, 13, 0); '2.9.0a0' -> (2, 9, 0): the leading number of each dotted part."""
    parts = []
    for piece in text.split("+")[0].split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def _range_text(key: str) -> str:
    low, high = SUPPORTED[key]
    low_text = ".".join(map(str, low))
    return f"{low_text} to {'.'.join(map(str, high))}" if high else f">= {low_text}"


def _exc_text(what: object) -> str:
    """An exception or a tool's output on one line, cut to a table cell's worth."""
    text = " ".join(str(what).split()) or type(what).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ------------------------------------------------------------------ software


def check_python(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    low, high = SUPPORTED["python"]
    shown = ".".join(map(str, version))
    if low <= tuple(version[:2]) <= high:
        return Check("python", PASS, f"{shown} (supported: {_range_text('python')})")
    return Check("python", FAIL, f"{shown} is not supported ({_range_text('python')})",
                 f"install orin-omni into a venv made with Python {_range_text('python')}, e.g. python3.10 -m venv")


def torch_install_hint(l4t_release: str | None) -> str:
    """The torch install command for this board: JetPack 6 is L4T R36, JetPack 7 is R38 and later."""
    major = _version(l4t_release.lstrip("Rr"))[:1] if l4t_release else ()
    if major and major[0] >= 38:
        return TORCH_INSTALL["jetpack7"]
    if major and major[0] == 36:
        return TORCH_INSTALL["jetpack6"]
    return " or ".join(TORCH_INSTALL.values())


def check_torch(torch, import_error: str | None, l4t_release: str | None) -> Check:
    if torch is None:
        return Check("torch", FAIL, f"not importable ({import_error})", torch_install_hint(l4t_release))
    version = _version(torch.__version__)
    low, high = SUPPORTED["torch"]
    cuda = getattr(torch.version, "cuda", None)
    build = f"CUDA {cuda} build" if cuda else "CPU-only build"
    if version[:2] < low or (high and version[:2] > high):
        return Check("torch", FAIL, f"{torch.__version__} is not supported ({_range_text('torch')})",
                     torch_install_hint(l4t_release))
    return Check("torch", PASS, f"{torch.__version__}, {build} (supported: {_range_text('torch')})")


# ------------------------------------------------------------------ GPU


def check_cuda(torch, device: str, l4t_release: str | None) -> tuple[Check, bool]:
    """(the check, whether CUDA is usable for the kernels: present, sm_80+, not --device cpu)."""
    if torch is None:
        return Check("cuda", SKIP, "torch is not installed"), False
    if device == "cpu":
        return Check("cuda", SKIP, "--device cpu"), False
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if not torch.version.cuda else "torch sees no CUDA device"
        if device == "cuda":
            return Check("cuda", FAIL, f"--device cuda, but {why}",
                         f"install the CUDA build of torch: {torch_install_hint(l4t_release)}; the user running "
                         "orin-omni must be in the 'video' and 'render' groups (sudo usermod -aG video,render $USER)"
                         ), False
        return Check("cuda", SKIP, f"{why}: the GPU checks are skipped (--device cuda makes this a failure)"), False
    cap = torch.cuda.get_device_capability(0)
    props = torch.cuda.get_device_properties(0)
    shown = f"{props.name}, sm_{cap[0]}{cap[1]}, CUDA {torch.version.cuda}, {format_bytes(props.total_memory)}"
    if tuple(cap) < MIN_CAPABILITY:
        return Check("cuda", FAIL, f"{shown}: torch's INT4 kernel needs sm_80 or newer",
                     "run on an Ampere or newer GPU (the AGX Orin is sm_87), or pass --device cpu"), False
    return Check("cuda", PASS, shown), True


def check_int4_kernel(torch, device: str) -> Check:
    """Pack a random GPTQ layer with the project's own code (orin.checkpoint.gptq_format -> orin.int4.linear's int4pack conversion),
    run torch's INT4 kernel on a few rows and compare with the dequantized float32 matmul."""
    name = "int4 kernel"
    if torch is None:
        return Check(name, SKIP, "torch is not installed")
    from ..checkpoint.gptq_format import dequantize_gptq_v1, random_gptq_v1
    from ..int4.linear import Int4Linear
    from ..int4.pack import int4_mm

    rows, K, N, g = INT4_SHAPE
    op = "aten._weight_int4pack_mm" + ("" if device == "cuda" else "_for_cpu")
    gen = torch.Generator().manual_seed(0)
    tensors = random_gptq_v1(K, N, g, generator=gen)
    x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
    reference = x.float() @ dequantize_gptq_v1(tensors, K).t()
    try:
        with torch.no_grad():
            layer = Int4Linear.from_gptq(tensors, K, device, dtype=torch.bfloat16, name="doctor")
            y = int4_mm(x.to(device), layer.weight_packed, layer.kernel_group_size,  # torch's INT4 kernel itself
                        layer.scales_and_zeros).float()[:, :N].cpu()
    except Exception as exc:  # noqa: BLE001 - any kernel failure is the finding, reported with its fix
        return Check(name, FAIL, f"{op} failed: {_exc_text(exc)}",
                     "install the torch build made for this board (its INT4 kernels come with it): "
                     f"{' or '.join(TORCH_INSTALL.values())}")
    err = float((y - reference).norm() / reference.norm())
    if not err <= INT4_TOLERANCE:
        return Check(name, FAIL, f"{op} is wrong: relative error {err:.3g} against the dequantized matmul "
                     f"(tolerance {INT4_TOLERANCE})",
                     "this torch's int4pack layout differs from the one orin.int4.linear writes; install a supported "
                     f"torch ({_range_text('torch')}) and report the version")
    return Check(name, PASS, f"{op} on {device}: {rows}x{K} @ {K}x{N} (group {g}), relative error {err:.2g}")


def check_triton(torch, cuda_ok: bool, cuda_why: str, unit_name: str) -> Check:
    """Compile and run one of the project's kernels (orin.kernels.router's fused softmax/top-k)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return Check("triton", SKIP, "not installed (optional): the INT4 MoE runs on torch ops instead, slower prefill")
    if not cuda_ok:
        return Check("triton", SKIP, f"{cuda_why}: the Triton kernels run on CUDA only")
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - a broken install fails in its own way
        return Check("triton", FAIL, f"installed but does not import: {_exc_text(exc)}",
                     "reinstall the Triton that matches this torch (pip install --force-reinstall triton, from "
                     "the same index as torch)")
    try:
        from ..kernels import router

        logits = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)).cuda()
        weights, ids = router.softmax_topk(logits, 8)
        want_w, want_ids = torch.topk(torch.softmax(logits.float(), -1), 8)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a compiler that cannot build for this GPU is the finding
        return Check("triton", FAIL, f"imports but cannot compile a kernel: {_exc_text(exc)}",
                     PTXAS_FIX.format(name=unit_name))
    if not (torch.equal(ids, want_ids) and torch.allclose(weights, want_w, atol=1e-5)):
        return Check("triton", FAIL, "the router kernel compiled but disagrees with torch.topk",
                     f"install a supported Triton (the one made for this torch, now {torch.__version__})")
    return Check("triton", PASS, f"{triton.__version__}: orin.kernels.router compiled and matches torch.topk")


def check_cuda_graph(torch, cuda_ok: bool, cuda_why: str) -> Check:
    """Capture two kernels into a CUDA graph and replay it on new input (the decode's graphs do this per step)."""
    if not cuda_ok:
        return Check("cuda graph", SKIP, cuda_why)
    try:
        x = torch.ones(256, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as torch's capture rules ask
            y = x * 2 + 1
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x * 2 + 1
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        ok = bool((y == 7).all())
    except Exception as exc:  # noqa: BLE001 - a driver that cannot capture is the finding
        return Check("cuda graph", FAIL, f"capture or replay failed: {_exc_text(exc)}",
                     f"update JetPack and install its torch build ({' or '.join(TORCH_INSTALL.values())})")
    if not ok:
        return Check("cuda graph", FAIL, "the replay computed the wrong values",
                     f"update JetPack and install its torch build ({' or '.join(TORCH_INSTALL.values())})")
    return Check("cuda graph", PASS, "capture and replay")


# ------------------------------------------------------------------ board


def check_power_backends(sysfs_root: str, jtop_socket: str, jetson: bool) -> list[Check]:
    """Open and read each backend the power meter can use (orin.power.meter's own), then say which one `auto` takes."""
    from ..errors import PowerError
    from ..power.meter import PowerConfig, make_backend

    cfg = PowerConfig(sysfs_root=sysfs_root, jtop_socket=jtop_socket)
    checks, working = [], []
    for name in ("jtop", "ina3221", "nvml"):
        backend = make_backend(name, cfg)
        try:
            backend.open()
            reading = backend.read()
        except PowerError as exc:
            checks.append(Check(f"power: {name}", SKIP, str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 - a third-party library failing its own way: unusable, say why
            checks.append(Check(f"power: {name}", SKIP, f"cannot open: {_exc_text(exc)}"))
            continue
        finally:
            backend.close()
        rails = ", ".join(sorted(reading.rails)) or "board total only"
        checks.append(Check(f"power: {name}", PASS, f"{reading.total_w:.1f} W now ({rails})"))
        working.append(name)
    if working:
        checks.append(Check("power", PASS, f"energy is measured with {working[0]} (auto picks it)"))
    elif jetson:
        checks.append(Check("power", FAIL, "no power backend works on this Jetson: energy is not measured",
                            "sudo systemctl start jtop (install: sudo pip3 install jetson-stats==7.2.2), or make "
                            f"{Path(sysfs_root) / 'bus/i2c/devices'}/*/hwmon/*/ readable"))
    else:
        checks.append(Check("power", SKIP, "no power backend here (not a Jetson, no NVML): energy is not measured"))
    return checks


def check_nvpmodel(nvpmodel: str | None, jetson: bool, run: Runner = subprocess.run) -> Check:
    if nvpmodel is None:
        if jetson:
            return Check("nvpmodel", FAIL, "nvpmodel not found on this Jetson",
                         "sudo apt install nvidia-l4t-tools")
        return Check("nvpmodel", SKIP, "nvpmodel not found: not a Jetson")
    try:
        proc = run([nvpmodel, "-q"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("nvpmodel", FAIL, f"cannot run {nvpmodel} -q: {_exc_text(exc)}", f"sudo {nvpmodel} -q")
    if proc.returncode != 0:
        message = _exc_text(proc.stderr or proc.stdout or f"exit {proc.returncode}")
        return Check("nvpmodel", FAIL, f"{nvpmodel} -q failed: {message}", f"sudo {nvpmodel} -q")
    mode, mode_id = "", ""
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("NV Power Mode:"):
            mode = line.partition(":")[2].strip()
        elif line.isdigit() and not mode_id:
            mode_id = line
    if not mode:
        return Check("nvpmodel", FAIL, f"unexpected output of {nvpmodel} -q: {_exc_text(proc.stdout)!r}",
                     f"sudo {nvpmodel} -q --verbose")
    shown = f"{mode} (mode {mode_id})" if mode_id else mode
    if mode != "MAXN":
        shown += ": not MAXN, inference runs slower; sudo nvpmodel -m 0 (or install-service --power-mode MAXN)"
    return Check("nvpmodel", PASS, shown)


# ------------------------------------------------------------------ model


def read_meminfo(proc_root: str) -> dict[str, int]:
    """PROC_ROOT/meminfo as bytes per field (MemTotal, MemAvailable, ...); {} where there is none."""
    return _read_meminfo(str(Path(proc_root) / "meminfo"))


def plan_command(model_dir: str, budget: int, profile: str) -> str:
    """The `orin-omni plan` command that sizes what doctor sized: same budget, same device profile."""
    import shlex

    return shlex.join(["orin-omni", "plan", model_dir, "--budget", size_text(budget), "--device-profile", profile])


def check_memory(meminfo: dict[str, int], plan, budget: int, plan_error: str | None, model_dir: str | None,
                 profile: str = "auto") -> Check:
    """The machine's memory against what the planner says the standard request needs at the budget (on a Jetson
    the GPU shares this DRAM). `profile`: the device profile doctor planned with, named in the fixes."""
    total, available = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
    if total is None or available is None:
        return Check("memory", SKIP, "no MemTotal/MemAvailable in meminfo (not Linux?)")
    have = f"{format_bytes(available)} available of {format_bytes(total)}"
    if model_dir is None:
        return Check("memory", SKIP, f"{have}; no model directory to size against")
    plan_cmd = plan_command(model_dir, budget, profile)
    if plan is None:
        return Check("memory", FAIL, f"{have}; the planner cannot size {model_dir}: {plan_error}",
                     f"{plan_cmd} shows why")
    verdict = plan.verdict
    need = verdict.peak_bytes
    if not verdict.time_sliced:
        return Check("memory", FAIL, f"the standard request at budget {format_bytes(budget)}: {verdict.reason}",
                     f"raise --budget to at least {size_text(-(-verdict.min_budget // (1 << 20)) << 20)} (the budget "
                     f"install-service was given); `{plan_cmd}` shows what fits")
    mode = "all-resident" if verdict.all_resident else "time-sliced"
    needs = (f"the standard request needs {format_bytes(need)} at budget {format_bytes(budget)} ({mode}, device "
             f"profile {plan.profile.name})")
    if need > total:
        return Check("memory", FAIL, f"{needs}, more than this machine's {format_bytes(total)}",
                     f"lower the budget until it time-slices within {format_bytes(total)}: `{plan_cmd}` with a "
                     "smaller --budget")
    if need > available:
        return Check("memory", FAIL, f"{needs}, but only {format_bytes(available)} is available now",
                     "stop other programs holding memory (a running orin-omni counts: stop it to check a new "
                     f"setup), or lower the budget: `{plan_cmd}` with a smaller --budget")
    return Check("memory", PASS, f"{needs}; {have}")


def check_disk(model_dir: str) -> Check:
    import shutil

    usage = shutil.disk_usage(model_dir)
    detail = f"{format_bytes(usage.free)} free of {format_bytes(usage.total)} on the model's filesystem"
    if usage.free < DISK_MIN_FREE:
        return Check("disk", FAIL, f"{detail}; the journal and the kernel compile caches need "
                     f"{format_bytes(DISK_MIN_FREE)}", "free space on that filesystem (sudo journalctl --vacuum-size=200M, "
                     "remove old checkpoints)")
    return Check("disk", PASS, detail)


def check_model_dir(model_dir: str | None, source: str):
    """(the check, the manifest or None). A model under /tmp serves by hand but not as the service (PrivateTmp
    hides it, and install-service refuses it at /): a warning on a pass, the same whichever way doctor is run."""
    from ..checkpoint.manifest import read_manifest
    from ..service.unit import TMP_ROOTS, is_under

    if model_dir is None:
        return Check("model dir", SKIP, "no --model-dir given and no installed unit names one"), None
    path = Path(model_dir)
    copy_fix = "copy the quantized checkpoint (orin-omni quantize's --out) there, or pass --model-dir DIR"
    if not path.is_dir():
        return Check("model dir", FAIL, f"{model_dir} ({source}) is not a directory", copy_fix), None
    if not (path / "config.json").is_file():
        return Check("model dir", FAIL, f"{model_dir} ({source}) has no config.json", copy_fix), None
    try:
        manifest = read_manifest(path)
    except OrinError as exc:
        return Check("model dir", FAIL, str(exc), copy_fix), None
    detail = f"{model_dir} ({source}): {manifest.model_name}, segments {', '.join(manifest.finished) or 'none'}"
    real = os.path.realpath(model_dir)
    if is_under(real, TMP_ROOTS):
        detail += (f"; warning: {real} is under /tmp or /var/tmp, which the service replaces with a private one "
                   f"(PrivateTmp), so install-service refuses it; for the service, move it: sudo mkdir -p "
                   f"/opt/models && sudo mv {real} /opt/models/")
    return Check("model dir", PASS, detail), manifest


def check_checksums(model_dir: str, manifest) -> Check:
    """Every file the manifest lists, against its size and sha256 (all of them, naming each bad one)."""
    from ..checkpoint.manifest import verify_file

    refetch = ("copy the checkpoint again from the quantize machine (e.g. rsync -a --checksum OUT/ "
               f"board:{model_dir}/), or re-run orin-omni quantize --force there for the segment")
    missing = [n for n in manifest.split if n not in manifest.segments]
    if missing:
        return Check("checksums", FAIL, f"segment(s) {', '.join(missing)} not finished (the quantize run stopped)",
                     "re-run the same orin-omni quantize command (it resumes), then copy the checkpoint again")
    entries = [*manifest.shared_files, *(f for n in manifest.finished for f in manifest.segment(n).files)]
    bad = []
    for entry in entries:
        try:
            verify_file(model_dir, entry)
        except OrinError as exc:
            bad.append(str(exc))
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        return Check("checksums", FAIL, f"{len(bad)} of {len(entries)} files bad: " + "; ".join(bad[:3]) + more,
                     refetch)
    return Check("checksums", PASS, f"{len(entries)} files match the manifest (size and sha256)")


def check_access(model_dir: str, user: str, interpreter: str | None) -> Check:
    """Whether the service user can read every file of the model and run the interpreter (orin.service.access)."""
    import pwd

    from ..service.access import access_fix_commands, model_access_problems

    try:
        pwd.getpwnam(user)
    except KeyError:
        return Check("model access", SKIP, f"user {user} does not exist yet (install-service creates it)")
    try:
        problems = model_access_problems(model_dir, user, interpreter)
    except OrinError as exc:
        return Check("model access", FAIL, str(exc), "run orin-omni doctor as root, or fix the path it names")
    if not problems:
        return Check("model access", PASS, f"user {user} can read {model_dir} and run {interpreter}")
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return Check("model access", FAIL, f"user {user}: " + "; ".join(p.describe() for p in problems[:3]) + more,
                 "\n".join(f"sudo {c}" for c in access_fix_commands(model_dir, user, problems)))
