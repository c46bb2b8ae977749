"""Tensor-core Triton kernels over tokens grouped by adapter slot (prefill-sized batches).

Both walk the tile list of ``AdapterBatchMeta`` (grid axis 0): a tile is up to
``block_m`` tokens of one slot, so each program reads one adapter's weights.

``seg_down_dot``: out[s, t, r] = act(x[t] @ A[s, row0 + r] + bias[slot, r]) for
r < rank[s, slot]. The rank rows of all slices of a slot are packed back to back and
grid axis 1 walks blocks of that list, so a slot costs the sum of its ranks.

``seg_up_dot``: y[t, cols_s] += v[s, t, :r] @ B[row0 : row0 + r, cols_s] (+ bias).
Grid axis 1 walks column groups of every slice; rank loops stop at each slot's rank.
"""
from __future__ import annotations

import triton
import triton.language as tl

from adapterserve.kernels.segment_common import activate_slot, packed_rows, slice_group, tile_tokens


@triton.jit
def seg_down_dot(
    x_ptr, a_ptr, out_ptr, bias_ptr, codes_ptr, rank_ptr, row_start_ptr,
    sorted_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr,
    K, max_rank,
    stride_xt, stride_xk,
    stride_as, stride_aslot, stride_ar, stride_ak,
    stride_os, stride_ot, stride_or,
    stride_rs, stride_rslot, stride_bias,
    NUM_SLICES: tl.constexpr, HAS_ROW_START: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, A_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
):
    pid, cb = tl.program_id(0), tl.program_id(1)
    slot, tok, tmask = tile_tokens(tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, sorted_ptr, pid, BLOCK_M)
    if slot < 0:
        return
    lane = tl.arange(0, BLOCK_R)  # ROWS of the BLOCK_R lanes carry rank rows
    j = cb * ROWS + lane
    a_off, o_off, valid, total = packed_rows(
        rank_ptr, row_start_ptr, slot, j, lane < ROWS, max_rank,
        stride_as, stride_aslot, stride_ar, stride_os, stride_or, stride_rs, stride_rslot,
        NUM_SLICES, HAS_ROW_START,
    )
    if cb * ROWS >= total:
        return
    if A_ALIGN > 1:  # tl.where hides that every row offset is a multiple of the strides
        a_off = tl.multiple_of(a_off, A_ALIGN)
    x_rows = x_ptr + tok * stride_xt
    a_rows = a_ptr + a_off
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xm = tmask[:, None]
            am = valid[:, None]
        else:
            xm = tmask[:, None] & (k < K)[None, :]
            am = valid[:, None] & (k < K)[None, :]
        xt = tl.load(x_rows[:, None] + k[None, :] * stride_xk, mask=xm, other=0.0)
        at = tl.load(a_rows[:, None] + k[None, :] * stride_ak, mask=am, other=0.0)
        acc += tl.dot(xt.to(at.dtype), tl.trans(at), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        tl.static_assert(NUM_SLICES == 1)
        acc += tl.load(bias_ptr + slot * stride_bias + j, mask=valid, other=0.0).to(tl.float32)[None, :]
    acc = activate_slot(acc, codes_ptr, slot, ACT)
    out = out_ptr + tok[:, None] * stride_ot + o_off[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & valid[None, :])


@triton.jit
def _cols(n0, step, n_end, N_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr):
    """Columns of chunk `step` of a group and their mask (empty past the group or slice)."""
    n = n0 + step + tl.arange(0, BLOCK_N)
    if N_ALIGN > 1:  # tl.where hides that every chunk starts on a multiple of the offsets
        n = tl.max_contiguous(tl.multiple_of(n, N_ALIGN), BLOCK_N)
    return n, (n < n_end) & (step < GROUP_N)


@triton.jit
def seg_up_dot(
    v_ptr, b_ptr, y_ptr, bias_ptr, rank_ptr, row_start_ptr,
    sorted_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr,
    max_rank, c1, c2, c3, c4,
    stride_vs, stride_vt, stride_vr,
    stride_bslot, stride_br, stride_bn,
    stride_yt, stride_yn,
    stride_rs, stride_rslot, stride_bias,
    NUM_SLICES: tl.constexpr, HAS_ROW_START: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, N_ALIGN: tl.constexpr, ONE_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr,
):
    pid, pid_g = tl.program_id(0), tl.program_id(1)
    slot, tok, tmask = tile_tokens(tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, sorted_ptr, pid, BLOCK_M)
    if slot < 0:
        return
    sl, n0, n_end = slice_group(pid_g, c1, c2, c3, c4, NUM_SLICES, GROUP_N)
    rank = tl.minimum(tl.load(rank_ptr + sl * stride_rs + slot * stride_rslot), max_rank)
    row0 = 0
    if HAS_ROW_START:
        row0 = tl.load(row_start_ptr + sl * stride_rs + slot * stride_rslot)
    if rank == 0:
        return
    v_rows = v_ptr + sl.to(tl.int64) * stride_vs + tok * stride_vt
    b_slot = b_ptr + slot.to(tl.int64) * stride_bslot
    r = tl.arange(0, BLOCK_R)
    if ONE_R:  # every rank fits one block: load v once, stream B and y over the group
        rmask = r < rank
        vt = tl.load(v_rows[:, None] + r[None, :] * stride_vr, mask=tmask[:, None] & rmask[None, :], other=0.0)
        b_rows = b_slot + (row0 + r).to(tl.int64)[:, None] * stride_br
    y_rows = y_ptr + tok[:, None] * stride_yt
    n, nmask = _cols(n0, 0, n_end, N_ALIGN, BLOCK_N, GROUP_N)
    y_old = tl.load(y_rows + n[None, :] * stride_yn, mask=tmask[:, None] & nmask[None, :], other=0.0)
    for step in range(0, GROUP_N, BLOCK_N):
        # prefetch the next chunk of y while this one is computed
        n_next, nmask_next = _cols(n0, step + BLOCK_N, n_end, N_ALIGN, BLOCK_N, GROUP_N)
        y_next = tl.load(y_rows + n_next[None, :] * stride_yn, mask=tmask[:, None] & nmask_next[None, :], other=0.0)
        if ONE_R:
            bt = tl.load(b_rows + n[None, :] * stride_bn, mask=rmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(vt.to(bt.dtype), bt, input_precision=DOT_PRECISION)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                rr = r0 + r
                rmask2 = rr < rank
                vmask = tmask[:, None] & rmask2[None, :]
                vt2 = tl.load(v_rows[:, None] + rr[None, :] * stride_vr, mask=vmask, other=0.0)
                rows = (row0 + rr).to(tl.int64)
                bt2 = tl.load(
                    b_slot + rows[:, None] * stride_br + n[None, :] * stride_bn,
                    mask=rmask2[:, None] & nmask[None, :], other=0.0,
                )
                acc += tl.dot(vt2.to(bt2.dtype), bt2, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + slot * stride_bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        new = (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty)
        tl.store(y_rows + n[None, :] * stride_yn, new, mask=tmask[:, None] & nmask[None, :])
        n, nmask, y_old = n_next, nmask_next, y_next
