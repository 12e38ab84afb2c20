"""The device's capabilities, probed once when an engine starts, and the profile built from them
(orin.device.profile). Each probe runs a tiny problem and compares it with a reference; a probe that fails
means that capability is off (one log line), never a failure of the engine. One thing does stop the engine: an
allocator configuration the device cannot run (orin.device.allocator_conf), refused before any probe allocates."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from .allocator_conf import AllocatorConf, check_allocator, process_allocator_conf
from .profile import DeviceProfile, for_arch

log = logging.getLogger("orin.device")


def detect(device, dtype=None, allocator: AllocatorConf | None = None) -> DeviceProfile:
    """The profile of `device` (a torch.device) with its capabilities probed: the engine's one call. `allocator`:
    the caching allocator's configuration to check (None: this process's environment's); a UsageError where the
    device cannot run it."""
    import torch

    if device.type != "cuda":  # torch._grouped_mm runs on the CPU too in newer torch
        return for_arch(cuda=False).with_capabilities(grouped_mm=grouped_mm_works(device, dtype or torch.float32))
    capability = torch.cuda.get_device_capability(device)
    base = cuda_base_profile(capability, is_tegra(), allocator if allocator is not None else process_allocator_conf())
    dtype = dtype or torch.bfloat16
    profile = base.with_capabilities(
        cuda=True,
        triton=triton_works(device),
        grouped_mm=grouped_mm_works(device, dtype),
        flash_lower_right=flash_lower_right_works(device, dtype),
        cudnn_whole_prompt=cudnn_whole_prompt_works(device),
        unified_memory=base.capabilities.unified_memory,
    )
    torch.cuda.empty_cache()  # the probes' blocks: what the engine then holds is its own (a budget counts it)
    return profile


def cuda_base_profile(capability: tuple[int, int], tegra: bool, allocator: AllocatorConf) -> DeviceProfile:
    """The base profile of a CUDA device, once its allocator configuration is known to run there (a Tegra
    device's unified memory refuses expandable segments: orin.device.allocator_conf)."""
    base = for_arch(cuda=True, capability=capability, tegra=tegra)
    check_allocator(allocator, base.capabilities.unified_memory)
    return base


def is_tegra(root: str = "/") -> bool:
    """A Jetson (L4T): its release file exists. Its GPU shares the host's DRAM."""
    return (Path(root) / "etc" / "nv_tegra_release").exists()


def triton_installed() -> bool:
    """Triton is importable (CUDA builds of torch bring it) and torch sees a GPU."""
    import torch

    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def triton_works(device) -> bool:
    """orin's Triton kernels import (a Triton too old for them fails here) on a CUDA device and pass their
    start-up check against the torch references (orin.kernels.check, once per device): only then may the MoE's
    "triton" backend be chosen."""
    if device.type != "cuda" or not triton_installed():
        return False
    try:  # registers torch.ops.orin.int4_moe_gemv and torch.ops.orin.softmax_topk
        from ..kernels import check, int4_gemm, router  # noqa: F401
    except ImportError as exc:
        log.warning("orin's Triton kernels cannot load (%s); the torch backends run instead", exc)
        return False
    return check.passes(device)


def grouped_mm_works(device, dtype) -> bool:
    """torch._grouped_mm runs here: tried on a tiny problem."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros((16, 16), device=device, dtype=dtype)
        b = torch.zeros((2, 16, 16), device=device, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        log.info("torch._grouped_mm unavailable (%s); the MoE's prompt runs per-expert GEMMs", exc)
        return False
    return True


def flash_lower_right_works(device, dtype, head_dim: int = 128) -> bool:
    """aten's flash kernel runs here and masks a chunk lower-right: checked against SDPA with the lower-right
    bias on a small problem (a build without flash for this GPU, or one whose causal alignment differs, keeps the
    SDPA path)."""
    import torch
    import torch.nn.functional as F

    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator(device=device).manual_seed(0)
    T, L, heads, kv, hd = 48, 160, 4, 2, head_dim
    qs = torch.randn((heads, T, hd), generator=gen, device=device, dtype=dtype)
    ks = torch.randn((1, kv, L, hd), generator=gen, device=device, dtype=dtype)
    vs = torch.randn((1, kv, L, hd), generator=gen, device=device, dtype=dtype)
    try:
        got = torch.ops.aten._flash_attention_forward(qs.transpose(0, 1).unsqueeze(0), ks.transpose(1, 2),
                                                      vs.transpose(1, 2), None, None, T, L, 0.0, True, False,
                                                      scale=hd ** -0.5)[0][0].transpose(0, 1)
        want = F.scaled_dot_product_attention(qs.unsqueeze(0), ks.repeat_interleave(heads // kv, 1),
                                              vs.repeat_interleave(heads // kv, 1),
                                              attn_mask=causal_lower_right(T, L), scale=hd ** -0.5)[0]
        return bool((got.float() - want.float()).abs().max() < 2e-2)
    except (RuntimeError, NotImplementedError) as exc:
        log.info("flash attention unavailable for prefill chunks (%s); using SDPA", exc)
        return False


def cudnn_whole_prompt_works(device) -> bool:
    """A long prompt's attention can run whole on cuDNN's kernel: a Hopper or newer GPU (where cuDNN's causal
    attention runs at twice flash-attention 2's rate) whose build computes a small causal GQA problem as the
    math path does. Elsewhere, the Orin included, a long prompt goes a chunk of queries at a time on flash."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((1, 4, 96, 128), generator=gen, device=device, dtype=torch.bfloat16)
    k = torch.randn((1, 1, 96, 128), generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn((1, 1, 96, 128), generator=gen, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel([SDPBackend.MATH]):
            want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        return bool((got.float() - want).abs().max() < 2e-2)
    except (RuntimeError, NotImplementedError) as exc:
        log.info("cuDNN attention unavailable for long prompts (%s); using flash in chunks", exc)
        return False
