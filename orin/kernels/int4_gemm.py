"""Triton kernels that read torch's CUDA int4pack layout in place: the prefill's grouped INT4 GEMM, a
dequantizer for dense layers, and the decode's chosen-experts GEMV.

tinygemm (``aten._weight_int4pack_mm``) is shaped for a few rows: at hundreds of rows it is ~10x off a dense
GEMM, and a MoE layer needs one launch per expert plus a host sync for the per-expert row counts.

- ``grouped_int4_mm``: all experts' rows of a layer in one launch, ``out[r] = x[r] @ W[e(r)].T`` for rows
  sorted by expert, with the group boundaries read on the device (no host sync: the host runs ahead). One
  program per (expert, BLOCK_M rows, BLOCK_N outputs) loops over K one int4pack super-tile (16 * tiles
  columns) at a time, dequantizing in registers: the weights are read at 0.5 byte per row block.
- ``dequantize``: the weight of a dense layer in the compute dtype, for one cuBLAS GEMM (prefill, encoders).
- ``moe_gemv``: decode's k chosen experts for one token, read where they lie (no gather of their tiles),
  split along K so that enough programs keep enough bytes in flight.

The layout (``orin.int4.pack._codes_cuda`` derives it from ``int4mm.cu``): row n lives in lanes
``4 * (n % 8) + tk`` of n-tile ``n // 8``, so each row's words of a super-tile are one contiguous run of
``4 * tiles/2`` words; column ``32 j + 16 a + 8 b + 2 tk + h`` of the super-tile is nibble ``4 h + 2 a + b``
of lane tk's word j. The GEMM and the GEMV load the runs as they lie (coalesced) and take nibbles in storage
order, taking the activations' columns in that same order instead (a dot product does not care in which
order k runs: the GEMM's callers permute them once, ``nibble_order``; the GEMV gathers its one row in the
kernel); the dequantizer writes in column order.

Needs Triton (it comes with CUDA builds of torch): import this module only where the device profile has Triton
(orin.int4.moe.triton_runs); the torch backends run tinygemm and torch ops elsewhere. The kernels also run
under Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is how the test suite checks them without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Tuned on an H200 at the thinker's shapes: the grouped GEMM with 32-row blocks, 128 outputs,
# 4 warps, 3 pipeline stages and one tl.dot per nibble position, activations in nibble order: 0.23 + 0.13 ms
# for a layer's gate/up and down at 467 tokens, against 0.42 + 0.23 with the columns gathered in the kernel
# (16-row blocks, 8 warps); one tl.dot per super-tile, or scales applied after the dot, were slower.
GEMM_BLOCK_M = 32
GEMM_BLOCK_N = 128
GEMM_WARPS = 4
GEMM_STAGES = 3
# The dequantization's outputs per program and warps: every expert of a layer at once, 16 outputs a program ran at
# 1.43-1.56 TB/s on the H200 against 0.91-0.98 at 32 and less at 64 or 128, with 4 or 8 warps
# (scripts/bench_long_moe_kernels.py at the talker's and the thinker's expert shapes; the same bits).
DEQUANT_BLOCK_N = 16
DEQUANT_WARPS = 4
GEMV_BLOCK_N = 32
GEMV_SUPER_TILES = 4  # super-tiles (of K) per GEMV program: the rest of K goes to other programs


@triton.jit
def _column(word, nib, J):
    """The super-tile column of nibble `nib` of a row's word `word` (see the module doc)."""
    return 32 * (word % J) + 16 * ((nib // 2) % 2) + 8 * (nib % 2) + 2 * (word // J) + nib // 4

@triton.jit
def grouped_gemm(
    x_ptr, packed_ptr, sz_ptr, ends_ptr, out_ptr,
    K, N_pad, n_tiles, k_outer, groups, m_blocks,
    J: tl.constexpr, KG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    SK: tl.constexpr = 32 * J
    W: tl.constexpr = 4 * J
    # one program per (expert, row block, output block): routing is uneven (an expert may take most of the
    # tokens), so an expert's row blocks run side by side; programs past their expert's rows do nothing
    e = tl.program_id(0) // m_blocks
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    r0 = start + (tl.program_id(0) % m_blocks) * BLOCK_M
    if r0 < end:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N_pad
        wi = tl.arange(0, W)
        rows = (rn // 8) * (k_outer * 32 * J) + (rn % 8) * W
        w_ptrs = packed_ptr + e.to(tl.int64) * n_tiles * k_outer * 32 * J + rows[:, None] + wi[None, :]
        s_base = sz_ptr + e.to(tl.int64) * groups * N_pad * 2
        rm = r0 + tl.arange(0, BLOCK_M)
        m_ok = rm < end
        x_rows = x_ptr + rm[:, None].to(tl.int64) * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ko in range(0, k_outer):
            k0 = ko * SK
            words = tl.load(w_ptrs + ko * 32 * J, mask=n_ok[:, None], other=0)  # [BLOCK_N, W]
            if KG >= SK:
                g = k0 // KG
                s = tl.load(s_base + (g * N_pad + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)
                z = tl.load(s_base + (g * N_pad + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
            for sn in tl.static_range(8):  # one dot of W columns per nibble position
                kc = k0 + _column(wi, sn, J)
                # x arrives in nibble order (nibble_order): the W columns of a nibble are contiguous
                xk = tl.load(x_rows + (k0 + sn * W + wi)[None, :], mask=m_ok[:, None], other=0.0)
                q = ((words >> (4 * sn)) & 0xF).to(tl.float32) - 8.0
                if KG >= SK:
                    w = q * s[:, None] + z[:, None]
                else:
                    offs = ((kc // KG)[None, :] * N_pad + rn[:, None]) * 2
                    w = q * tl.load(s_base + offs, mask=n_ok[:, None], other=0.0).to(tl.float32) + \
                        tl.load(s_base + offs + 1, mask=n_ok[:, None], other=0.0).to(tl.float32)
                acc += tl.dot(xk, tl.trans(w.to(xk.dtype)))
        tl.store(out_ptr + rm[:, None].to(tl.int64) * N_pad + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def dequant(
    packed_ptr, sz_ptr, out_ptr, N_pad, n_tiles, k_outer, groups,
    J: tl.constexpr, KG: tl.constexpr, BLOCK_N: tl.constexpr,
):
    SK: tl.constexpr = 32 * J
    e = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ko = tl.program_id(2)
    n_ok = rn < N_pad
    # column order: each output row segment is written contiguously; its words are re-read per column
    # (a row's run is 4 * J words: the repeats are L1 hits)
    kk = tl.arange(0, SK)
    word = ((kk // 2) % 4) * J + kk // 32
    shift = 4 * (4 * (kk % 2) + 2 * ((kk // 16) % 2) + (kk // 8) % 2)
    rows = (rn // 8) * (k_outer * 32 * J) + (rn % 8) * (4 * J)
    words = tl.load(packed_ptr + e * n_tiles * k_outer * 32 * J + ko * 32 * J + rows[:, None] + word[None, :],
                    mask=n_ok[:, None], other=0)
    q = ((words >> shift[None, :]) & 0xF).to(tl.float32) - 8.0
    s_base = sz_ptr + e * groups * N_pad * 2
    g = (ko * SK + kk) // KG
    offs = (g[None, :] * N_pad + rn[:, None]) * 2
    s = tl.load(s_base + offs, mask=n_ok[:, None], other=0.0).to(tl.float32)
    z = tl.load(s_base + offs + 1, mask=n_ok[:, None], other=0.0).to(tl.float32)
    K = k_outer * SK
    tl.store(out_ptr + e * N_pad * K + rn[:, None].to(tl.int64) * K + ko * SK + kk[None, :],
             (q * s + z).to(out_ptr.dtype.element_ty), mask=n_ok[:, None])

@triton.jit
def gemv(
    x_ptr, x_stride, packed_ptr, sz_ptr, sel_ptr, out_ptr, N_pad, n_tiles, k_outer, groups, n_sel,
    J: tl.constexpr, KG: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
):
    SK: tl.constexpr = 32 * J
    W: tl.constexpr = 4 * J
    j = tl.program_id(1)
    part = tl.program_id(2)
    e = tl.load(sel_ptr + j).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N_pad
    wi = tl.arange(0, W)
    rows = (rn // 8) * (k_outer * 32 * J) + (rn % 8) * W
    w_ptrs = packed_ptr + e * n_tiles * k_outer * 32 * J + rows[:, None] + wi[None, :]
    s_base = sz_ptr + e * groups * N_pad * 2
    x_row = x_ptr + j * x_stride
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in tl.static_range(TILES):
        ko = part * TILES + t
        if ko < k_outer:
            k0 = ko * SK
            words = tl.load(w_ptrs + ko * 32 * J, mask=n_ok[:, None], other=0)
            if KG >= SK:
                # one group per super-tile: sum_k (s (q - 8) + z) x = s * sum (q - 8) x + z * sum x
                g = k0 // KG
                s = tl.load(s_base + (g * N_pad + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)
                z = tl.load(s_base + (g * N_pad + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
                qx = tl.zeros((BLOCK_N, W), dtype=tl.float32)
                xs = tl.zeros((W,), dtype=tl.float32)
                for sn in tl.static_range(8):
                    xv = tl.load(x_row + k0 + _column(wi, sn, J)).to(tl.float32)
                    qx += (((words >> (4 * sn)) & 0xF).to(tl.float32) - 8.0) * xv[None, :]
                    xs += xv
                acc += s * tl.sum(qx, axis=1) + z * tl.sum(xs, axis=0)
            else:
                tw = tl.zeros((BLOCK_N, W), dtype=tl.float32)
                for sn in tl.static_range(8):
                    kc = k0 + _column(wi, sn, J)
                    xv = tl.load(x_row + kc).to(tl.float32)
                    offs = ((kc // KG)[None, :] * N_pad + rn[:, None]) * 2
                    sg = tl.load(s_base + offs, mask=n_ok[:, None], other=0.0).to(tl.float32)
                    zg = tl.load(s_base + offs + 1, mask=n_ok[:, None], other=0.0).to(tl.float32)
                    tw += ((((words >> (4 * sn)) & 0xF).to(tl.float32) - 8.0) * sg + zg) * xv[None, :]
                acc += tl.sum(tw, axis=1)
    tl.store(out_ptr + (part * n_sel + j) * N_pad + rn, acc, mask=n_ok)



def _geometry(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(n_tiles, k_outer, tiles/2, groups, N_pad) of stacked [E, ...] packed weights and their scales."""
    _, n_tiles, k_outer, _, J = packed.shape
    return n_tiles, k_outer, J, scales_and_zeros.shape[1], scales_and_zeros.shape[2]


@functools.cache
def _nibble_order(K: int, J: int, device: torch.device) -> torch.Tensor:
    wi = torch.arange(4 * J)
    one = torch.cat([32 * (wi % J) + 16 * ((sn // 2) % 2) + 8 * (sn % 2) + 2 * (wi // J) + sn // 4
                     for sn in range(8)])
    return (torch.arange(0, K, 32 * J).unsqueeze(1) + one).reshape(-1).to(device)


def nibble_order(packed: torch.Tensor) -> torch.Tensor:
    """The column order grouped_int4_mm reads its activations in: x.index_select(1, nibble_order(packed))
    puts the columns of each super-tile's nibble position side by side, so the kernel loads them as
    contiguous runs (gathering them column by column inside the kernel made it 1.6x slower)."""
    _, _, k_outer, _, J = packed.shape
    return _nibble_order(k_outer * 32 * J, J, packed.device)


def grouped_int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int,
                    ends: torch.Tensor, max_rows: int | None = None, x_ordered: bool = False) -> torch.Tensor:
    """x [R, K_run] bf16 with rows sorted by expert (columns in ``nibble_order(packed)`` if ``x_ordered``,
    else put in it here); ``ends`` int32 [E] on the device: expert e's rows are ``ends[e-1]:ends[e]`` (rows
    from ``ends[-1]`` on are left zero); ``max_rows`` bounds any expert's rows (the token count, when each
    token picks an expert at most once; default R); packed [E, N/8, K_run/(16*tiles), 32, tiles/2];
    scales_and_zeros [E, K_run/group, N_pad, 2] -> [R, N_pad]. Needs 4 inner k-tiles (K_run % 128 == 0, true
    at every layer of the real model): ``supports(packed)``."""
    n_tiles, k_outer, J, groups, N_pad = _geometry(packed, scales_and_zeros)
    R, K = x.shape
    if K != k_outer * 32 * J or ends.shape != (packed.shape[0],) or not supports(packed):
        raise ValueError(f"grouped_int4_mm: x {tuple(x.shape)}, packed {tuple(packed.shape)}, ends {tuple(ends.shape)}")
    if not x_ordered:
        x = x.index_select(1, nibble_order(packed))
    out = x.new_zeros((R, N_pad))
    if R:
        m_blocks = -(-min(R, max_rows or R) // GEMM_BLOCK_M)
        grid = (packed.shape[0] * m_blocks, -(-N_pad // GEMM_BLOCK_N))
        grouped_gemm[grid](
            x.contiguous(), packed, scales_and_zeros, ends.to(torch.int32).contiguous(), out,
            K, N_pad, n_tiles, k_outer, groups, m_blocks,
            J=J, KG=kernel_group, BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, num_warps=GEMM_WARPS,
            num_stages=GEMM_STAGES,
        )
    return out


def supports(packed: torch.Tensor) -> bool:
    """Whether grouped_int4_mm can take these packed weights (a tl.dot needs the 16 words of 4 inner tiles)."""
    return packed.shape[-1] == 4


def dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int,
               block_n: int = DEQUANT_BLOCK_N, num_warps: int = DEQUANT_WARPS) -> torch.Tensor:
    """The kernel's weight [..., N_pad, K_run] (scales' dtype) of CUDA int4pack weights [..., N/8, K/(16*tiles),
    32, tiles/2] with scales_and_zeros [..., K/group, N_pad, 2]; one leading (expert) dimension at most.
    `block_n`, `num_warps`: the launch's shape (scripts/bench_long_moe_kernels.py compares them)."""
    lead = packed.shape[:-4]
    p = packed.reshape(-1, *packed.shape[-4:])
    sz = scales_and_zeros.reshape(-1, *scales_and_zeros.shape[-3:])
    n_tiles, k_outer, J, groups, N_pad = _geometry(p, sz)
    out = torch.empty((p.shape[0], N_pad, k_outer * 32 * J), dtype=sz.dtype, device=p.device)
    dequant[(p.shape[0], -(-N_pad // block_n), k_outer)](
        p, sz, out, N_pad, n_tiles, k_outer, groups, J=J, KG=kernel_group, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out.view(*lead, N_pad, k_outer * 32 * J)


@torch.library.custom_op("orin::int4_moe_gemv", mutates_args=())
def moe_gemv(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, sel: torch.Tensor,
             kernel_group: int) -> torch.Tensor:
    """Decode's chosen experts, read in place: out[j] = x[j or 0] @ W[sel[j]].T for j < len(sel).

    x [1 or k, K_run] (one row shared by all, as gate/up, or one row each, as down); packed [E, N/8,
    K_run/(16*tiles), 32, tiles/2]; scales_and_zeros [E, K_run/group, N_pad, 2]; sel [k] expert ids (on the
    device: no host sync, so it runs inside a CUDA graph). -> float32 partial sums [parts, k, N_pad] over
    slices of K: the caller sums dim 0 (under torch.compile that sum fuses into the next elementwise kernel).
    A custom op, so that torch.compile keeps it opaque in the decoder layer."""
    n_tiles, k_outer, J, groups, N_pad = _geometry(packed, scales_and_zeros)
    k = sel.shape[0]
    parts = -(-k_outer // GEMV_SUPER_TILES)
    x = x.contiguous()
    out = torch.empty((parts, k, N_pad), dtype=torch.float32, device=x.device)
    gemv[(-(-N_pad // GEMV_BLOCK_N), k, parts)](
        x, 0 if x.shape[0] == 1 else x.shape[1], packed, scales_and_zeros, sel.contiguous(), out,
        N_pad, n_tiles, k_outer, groups, k, J=J, KG=kernel_group, BLOCK_N=GEMV_BLOCK_N, TILES=GEMV_SUPER_TILES,
        num_warps=4,
    )
    return out


@moe_gemv.register_fake
def _(x, packed, scales_and_zeros, sel, kernel_group):
    parts = -(-packed.shape[2] // GEMV_SUPER_TILES)
    return x.new_empty((parts, sel.shape[0], scales_and_zeros.shape[2]), dtype=torch.float32)
