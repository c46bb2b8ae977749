"""Weight-only FP8 GEMM: bf16 activations times float8_e4m3fn weights with one float32
scale per output channel, dequantized in the mainloop (Triton).

Semantics: ``y[m, n] = scale[n] * sum_k x[m, k] * float(w[n, k])`` in float32, stored in
x's dtype. The scale is per output channel, so it factors out of the K sum and is
applied once in the epilogue; the mainloop only widens each weight tile to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_weight_only_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    y = acc * scale[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tiles(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by batch rows: skinny decode
    tiles read many weight rows per program; prefill uses square tiles."""
    if m <= 16:
        return 16, 64, 256, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 4
    return 128, 128, 64, 8, 3


def fp8_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (bf16/f16/f32, last dim contiguous), weight: [N, K] float8_e4m3fn, scale: [N]
    float32 -> y: [M, N] in x's dtype (see the module's semantics)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = _tiles(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_weight_only_kernel[grid](x, weight, scale, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y
