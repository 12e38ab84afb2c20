"""torch's CUDA int4pack conversion transcribed in Python, so that CPU tests can build CUDA-layout weights."""

from __future__ import annotations

import torch


def cuda_int4pack_reference(codes: torch.Tensor, tiles: int) -> torch.Tensor:
    """torch's CUDA _convert_weight_to_int4pack, transcribed lane by lane from int4mm.cu (NVIDIA branch):
    codes [N, K] -> int32 [N/8, K/(16*tiles), 32, tiles/2]."""
    N, K = codes.shape
    c = codes.long()
    out = torch.zeros(N // 8, K // (16 * tiles), 32, tiles // 2, dtype=torch.int64)
    for n_tile in range(N // 8):
        for k_outer in range(K // (16 * tiles)):
            for t in range(32):
                n = n_tile * 8 + t // 4
                for inner in range(0, tiles, 2):
                    base0 = (k_outer * tiles + inner) * 16 // 2
                    ks = [base0 + t % 4, base0 + t % 4 + 4, base0 + 8 + t % 4, base0 + 8 + t % 4 + 4]
                    # uint8 [n][k/2] holds q[2j] in its high nibble, q[2j+1] in its low one
                    hi = [int(c[n, 2 * j]) for j in ks]
                    lo = [int(c[n, 2 * j + 1]) for j in ks]
                    word = sum(v << (16 + 4 * i) for i, v in enumerate(lo)) | sum(v << (4 * i) for i, v in enumerate(hi))
                    out[n_tile, k_outer, t, inner // 2] = word
    return (out - ((out >> 31) << 32)).to(torch.int32)  # as the kernel's int32 bit pattern
