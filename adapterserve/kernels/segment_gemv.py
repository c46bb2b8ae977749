"""CUDA-core Triton kernels for decode-sized batches: one program per token.

Same semantics as ``segment_gemm``, without tensor cores: with one token per slot a
16-row dot tile is 15/16 padding that still costs shared-memory traffic. Grid axis 0
is the token itself (its slot read from ``meta.token_slots``; slot -1 exits), so no
program ever loops over a slot's tokens; tokens of one adapter read its rows from L2
after the first. Each program streams its rows through registers, loading the next
chunk while the current one is used.

``seg_down_gemv``: ROWS packed rank rows of one token per program (HAS_MIX: of the
input x + mix[slot] * residual, a pre-LN bottleneck's, formed as it is read).
``seg_up_gemv``: BLOCK_N columns of one slice of one token, the slot's rank rows
BLOCK_R at a time, so each token pays its own adapter's rank (not the pool's largest).
"""
from __future__ import annotations

import triton
import triton.language as tl

from adapterserve.kernels.pdl import pdl_wait
from adapterserve.kernels.segment_common import activate_slot, packed_rows, slice_group


@triton.jit
def seg_down_gemv(
    x_ptr, a_ptr, out_ptr, bias_ptr, codes_ptr, rank_ptr, row_start_ptr, slots_ptr,
    K, max_rank,
    stride_xt, stride_xk,
    stride_as, stride_aslot, stride_ar, stride_ak,
    stride_os, stride_ot, stride_or,
    stride_rs, stride_rslot, stride_bias,
    NUM_SLICES: tl.constexpr, HAS_ROW_START: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, A_ALIGN: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
    res_ptr=None, mix_ptr=None, stride_rest=0, stride_resk=0, HAS_MIX: tl.constexpr = 0,
):
    t, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        pdl_wait(USE_PDL)
        return
    j = cb * ROWS + tl.arange(0, ROWS)
    a_off, o_off, valid, total = packed_rows(
        rank_ptr, row_start_ptr, slot, j, j >= 0, max_rank,
        stride_as, stride_aslot, stride_ar, stride_os, stride_or, stride_rs, stride_rslot,
        NUM_SLICES, HAS_ROW_START,
    )
    if cb * ROWS >= total:
        pdl_wait(USE_PDL)
        return
    if A_ALIGN > 1:  # tl.where hides that every row offset is a multiple of the strides
        a_off = tl.multiple_of(a_off, A_ALIGN)
    a_rows = a_ptr + a_off
    x_row = x_ptr + t * stride_xt
    kk = tl.arange(0, BLOCK_K)
    a_cur = tl.load(a_rows[:, None] + kk[None, :] * stride_ak, mask=valid[:, None] & (kk < K)[None, :], other=0.0)
    pdl_wait(USE_PDL)  # the slot's first chunk of A read before the wait, x after it
    mix = 0.0
    res_row = x_row
    if HAS_MIX:  # the input is x + mix[slot] * residual, formed here in float32
        mix = tl.load(mix_ptr + slot).to(tl.float32)
        res_row = res_ptr + t * stride_rest
    x_cur = _input_chunk(x_row, res_row, mix, kk, K, stride_xk, stride_resk, HAS_MIX)
    acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
        k = k0 + kk  # prefetch chunk k0 while chunk k0 - BLOCK_K is used
        a_next = tl.load(a_rows[:, None] + k[None, :] * stride_ak, mask=valid[:, None] & (k < K)[None, :], other=0.0)
        x_next = _input_chunk(x_row, res_row, mix, k, K, stride_xk, stride_resk, HAS_MIX)
        acc += a_cur.to(tl.float32) * x_cur[None, :]
        a_cur, x_cur = a_next, x_next
    res = tl.sum(acc, axis=1)
    if HAS_BIAS:
        tl.static_assert(NUM_SLICES == 1)
        res += tl.load(bias_ptr + slot * stride_bias + j, mask=valid, other=0.0).to(tl.float32)
    res = activate_slot(res, codes_ptr, slot, ACT)
    tl.store(out_ptr + t * stride_ot + o_off, res.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _input_chunk(x_row, res_row, mix, k, K, stride_xk, stride_resk, HAS_MIX: tl.constexpr):
    """Elements k of a token's input row in float32: x, or x + mix * residual."""
    x = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
    if HAS_MIX:
        x += mix * tl.load(res_row + k * stride_resk, mask=k < K, other=0.0).to(tl.float32)
    return x


@triton.jit
def seg_up_gemv(
    v_ptr, b_ptr, y_ptr, bias_ptr, rank_ptr, row_start_ptr, slots_ptr,
    max_rank, c1, c2, c3, c4,
    stride_vs, stride_vt, stride_vr,
    stride_bslot, stride_br, stride_bn,
    stride_yt, stride_yn,
    stride_rs, stride_rslot, stride_bias,
    NUM_SLICES: tl.constexpr, HAS_ROW_START: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    t, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        pdl_wait(USE_PDL)
        return
    sl, n0, n_end = slice_group(pid_n, c1, c2, c3, c4, NUM_SLICES, BLOCK_N)
    rank = tl.minimum(tl.load(rank_ptr + sl * stride_rs + slot * stride_rslot), max_rank)
    row0 = 0
    if HAS_ROW_START:
        row0 = tl.load(row_start_ptr + sl * stride_rs + slot * stride_rslot)
    if rank == 0:
        pdl_wait(USE_PDL)
        return
    n = n0 + tl.arange(0, BLOCK_N)
    if N_ALIGN > 1:  # tl.where hides that every block starts on a multiple of the offsets
        n = tl.max_contiguous(tl.multiple_of(n, N_ALIGN), BLOCK_N)
    nmask = n < n_end
    r = tl.arange(0, BLOCK_R)
    b_cols = b_ptr + slot.to(tl.int64) * stride_bslot + n[None, :] * stride_bn
    v_row = v_ptr + sl.to(tl.int64) * stride_vs + t * stride_vt
    rmask = r < rank  # the first BLOCK_R ranks outside the loop: low ranks run straight-line
    bt = tl.load(b_cols + (row0 + r).to(tl.int64)[:, None] * stride_br, mask=rmask[:, None] & nmask[None, :], other=0.0)
    pdl_wait(USE_PDL)  # the slot's first B rows read before the wait, the shrink and y after it
    vt = tl.load(v_row + r * stride_vr, mask=rmask, other=0.0)
    y = y_ptr + t * stride_yt + n * stride_yn
    old = tl.load(y, mask=nmask, other=0.0)
    upd = tl.sum(vt.to(tl.float32)[:, None] * bt.to(tl.float32), axis=0)
    for r0 in range(BLOCK_R, rank, BLOCK_R):
        rr = r0 + r
        rmask = rr < rank
        bt = tl.load(b_cols + (row0 + rr).to(tl.int64)[:, None] * stride_br, mask=rmask[:, None] & nmask[None, :],
                     other=0.0)
        vt = tl.load(v_row + rr * stride_vr, mask=rmask, other=0.0)
        upd += tl.sum(vt.to(tl.float32)[:, None] * bt.to(tl.float32), axis=0)
    if HAS_BIAS:
        upd += tl.load(bias_ptr + slot * stride_bias + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y, (old.to(tl.float32) + upd).to(y_ptr.dtype.element_ty), mask=nmask)
