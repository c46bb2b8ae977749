"""Triton (IA)^3 scaling: each token's features times its slot's vector, in place."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.metadata import AdapterBatchMeta


@triton.jit
def _ia3_kernel(x_ptr, scales_ptr, slots_ptr, N, stride_xt, stride_xn, stride_ss, stride_sn, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = n < N
    xp = x_ptr + t.to(tl.int64) * stride_xt + n * stride_xn
    scale = tl.load(scales_ptr + slot.to(tl.int64) * stride_ss + n * stride_sn, mask=mask, other=0.0)
    xv = tl.load(xp, mask=mask, other=0.0)
    tl.store(xp, (xv.to(tl.float32) * scale.to(tl.float32)).to(x_ptr.dtype.element_ty), mask=mask)


def ia3_scale(x: torch.Tensor, scales: torch.Tensor, meta: AdapterBatchMeta) -> None:
    """(IA)^3: scale each token's features by its slot's vector, in place.

    x: [T, N]; scales: [S, N].
    Semantics: x[t] *= scales[slot[t]]; slot -1 untouched.
    """
    if x.dim() != 2 or scales.dim() != 2 or scales.shape[1] != x.shape[1] or x.shape[0] != meta.num_tokens:
        raise ValueError(
            f"x must be [T={meta.num_tokens}, N] and scales [S, N]; got {tuple(x.shape)}, {tuple(scales.shape)}"
        )
    t, n = x.shape
    if t == 0 or n == 0:
        return
    block_n = min(1024, triton.next_power_of_2(n)) if x.is_cuda else min(256, triton.next_power_of_2(n))
    grid = (t, triton.cdiv(n, block_n))
    _ia3_kernel[grid](
        x, scales, meta.token_slots, n, x.stride(0), x.stride(1), scales.stride(0), scales.stride(1), BLOCK_N=block_n
    )
