"""Per-token Triton expand for the stacked layout (benchmarks compare it with the tiled
expand the engine runs, kernels/stacked_tiled.py).

One program per (token, column group): it loads the token's base output from the
stacked GEMM's output, adds the bias and, for a token with an adapter, its shrink
(read from its own columns of that output) times its own B rows, and writes the
layer's output row. One launch per linear whatever the adapters; tokens of one
adapter read its B rows from L2 after the first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.segment_common import MAX_SLICES, slice_group
from adapterserve.kernels.stacked import check_stacked

GPU_BLOCK_N = 512
GPU_BLOCK_R = 16
GPU_WARPS = 4


@triton.jit
def _stacked_expand_kernel(
    out_ptr, b_ptr, y_ptr, bias_ptr, rank_ptr, row_start_ptr, slots_ptr,
    n_out, rows, max_rank, c1, c2, c3, c4,
    stride_ot, stride_on, stride_br, stride_bn, stride_yt, stride_yn, stride_rs, stride_rslot,
    NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    sl, n0, n_end = slice_group(pid_n, c1, c2, c3, c4, NUM_SLICES, BLOCK_N)
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < n_end
    out_row = out_ptr + t * stride_ot
    acc = tl.load(out_row + n * stride_on, mask=nmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + t)
    safe = tl.maximum(slot, 0)
    rank = tl.minimum(tl.load(rank_ptr + sl * stride_rs + safe * stride_rslot), max_rank)
    row0 = tl.load(row_start_ptr + sl * stride_rs + safe * stride_rslot)
    rank = tl.where(slot >= 0, tl.minimum(rank, rows - row0), 0)  # never past the GEMM's rows
    r = tl.arange(0, BLOCK_R)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + r
        rmask = rr < rank
        prow = (row0 + rr).to(tl.int64)
        v = tl.load(out_row + (n_out + prow * NUM_SLICES + sl) * stride_on, mask=rmask, other=0.0)
        bt = tl.load(b_ptr + prow[:, None] * stride_br + n[None, :] * stride_bn,
                     mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc += tl.sum(v.to(tl.float32)[:, None] * bt.to(tl.float32), axis=0)
    tl.store(y_ptr + t * stride_yt + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


def stacked_expand(out: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor,
                   bias: torch.Tensor | None = None) -> None:
    """The layer output from a stacked GEMM's output, one launch.

    out: [T, N + rows * n_slices] from ``stacked.stacked_gemm``: base output, then
         column N + r * n_slices + s = x @ A_s[pool row r]
    y:   [T, N] written whole; bias: [N] or None
    Semantics: y[t, off_s : off_s1] = out[t, off_s : off_s1] + bias + sum over j < r of
    out[t, N + (row0 + j) * n_slices + s] * B[row0 + j, off_s : off_s1], with slot = slot[t],
    row0 = row_start[s, slot], r = rank[s, slot] (0 for slot -1). No other column of out is read.
    """
    rows = check_stacked(out, lora, meta, y, bias)
    t, n_slices = y.shape[0], lora.num_slices
    if t == 0:
        return
    block_n, block_r, warps = (GPU_BLOCK_N, GPU_BLOCK_R, GPU_WARPS) if y.is_cuda else (64, 16, 4)
    offs = lora.out_offsets
    groups = sum(triton.cdiv(offs[s + 1] - offs[s], block_n) for s in range(n_slices))
    c = list(offs[1:]) + [0] * (MAX_SLICES - n_slices)
    _stacked_expand_kernel[(t, groups)](
        out, lora.b, y, bias if bias is not None else y, lora.rank, lora.row_start, meta.token_slots,
        offs[-1], rows, lora.max_rank, *c,
        out.stride(0), out.stride(1), lora.b.stride(0), lora.b.stride(1), y.stride(0), y.stride(1),
        lora.rank.stride(0), lora.rank.stride(1),
        NUM_SLICES=n_slices, HAS_BIAS=bias is not None, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps,
    )
