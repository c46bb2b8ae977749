"""Triton helpers shared by the segment kernels: tiles, packed rank rows, slices, activations,
the stacked expands' base output."""
from __future__ import annotations

import triton
import triton.language as tl

MAX_SLICES = 4
ACT_CODES = {"none": 0, "relu": 1, "gelu": 2, "gelu_new": 3, "silu": 4, "swish": 4, "tanh": 5}
ACT_BY_SLOT = -1  # the ACT of a launch whose slots each name their own code (an int32 per slot)


@triton.jit
def _tanh(z):
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)  # tanh is +-1 to float32 there; keeps exp finite
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@triton.jit
def activate(z, ACT: tl.constexpr):
    """The activation of ACT_CODES, in float32."""
    if ACT == 1:
        z = tl.maximum(z, 0.0)
    if ACT == 2:
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    if ACT == 3:
        z = 0.5 * z * (1.0 + _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    if ACT == 4:
        z = z * tl.sigmoid(z)
    if ACT == 5:
        z = _tanh(z)
    return z


@triton.jit
def activate_slot(z, codes_ptr, slot, ACT: tl.constexpr):
    """activate(z, ACT); with ACT_BY_SLOT, the activation whose code slot ``slot`` holds.
    Every activation is computed and one kept: a few ops on a program's rank rows, and no
    variant, graph or launch per activation."""
    if ACT == -1:
        code = tl.load(codes_ptr + slot)
        out = tl.where(code == 1, activate(z, 1), z)
        out = tl.where(code == 2, activate(z, 2), out)
        out = tl.where(code == 3, activate(z, 3), out)
        out = tl.where(code == 4, activate(z, 4), out)
        z = tl.where(code == 5, activate(z, 5), out)
    else:
        z = activate(z, ACT)
    return z


@triton.jit
def _pick(i: tl.constexpr, v0, v1, v2, v3, v4):
    """v_i for a compile-time i (kernel arguments cannot be indexed)."""
    out = v0
    if i == 1:
        out = v1
    if i == 2:
        out = v2
    if i == 3:
        out = v3
    if i == 4:
        out = v4
    return out


@triton.jit
def tile_tokens(tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, sorted_ptr, pid, BLOCK_M: tl.constexpr):
    """Slot, token indices [BLOCK_M] (int64) and mask of tile pid: two dependent loads."""
    slot = tl.load(tile_slots_ptr + pid)
    start = tl.load(tile_starts_ptr + pid)
    end = tl.load(tile_ends_ptr + pid)
    pos = start + tl.arange(0, BLOCK_M)
    mask = pos < end  # empty for the padding tiles past the last one
    tok = tl.load(sorted_ptr + pos, mask=mask, other=0).to(tl.int64)
    return slot, tok, mask


@triton.jit
def packed_rows(
    rank_ptr, row_start_ptr, slot, j, lane_ok, max_rank,
    stride_as, stride_aslot, stride_ar, stride_os, stride_or, stride_rs, stride_rslot,
    NUM_SLICES: tl.constexpr, HAS_ROW_START: tl.constexpr,
):
    """Packed rank rows j (slice 0's rank, then slice 1's, ...) of one slot.

    Returns the A row offsets, output offsets, which j are real, and the slot's total rank.
    """
    a_off = j.to(tl.int64) * 0
    o_off = j.to(tl.int64) * 0
    valid = j < 0
    base = 0
    for s in tl.static_range(NUM_SLICES):
        rank = tl.minimum(tl.load(rank_ptr + s * stride_rs + slot * stride_rslot), max_rank)
        row0 = 0
        if HAS_ROW_START:
            row0 = tl.load(row_start_ptr + s * stride_rs + slot * stride_rslot)
        local = j - base
        in_s = (local >= 0) & (local < rank) & lane_ok
        rows = (row0 + local).to(tl.int64)
        s64 = tl.full([], s, tl.int64)
        a_off = tl.where(in_s, s64 * stride_as + slot.to(tl.int64) * stride_aslot + rows * stride_ar, a_off)
        o_off = tl.where(in_s, s64 * stride_os + local.to(tl.int64) * stride_or, o_off)
        valid = valid | in_s
        base = base + rank
    return a_off, o_off, valid, base


@triton.jit
def slice_group(pid_g, c1, c2, c3, c4, NUM_SLICES: tl.constexpr, GROUP_N: tl.constexpr):
    """Slice owning column group pid_g (slice s spans c_s .. c_{s+1}), its first column and end."""
    sl = 0
    n0 = 0
    n_end = 0
    first = 0
    for s in tl.static_range(NUM_SLICES):
        c_lo = _pick(s, 0, c1, c2, c3, c4)
        c_hi = _pick(s + 1, 0, c1, c2, c3, c4)
        groups = tl.cdiv(c_hi - c_lo, GROUP_N)
        mine = (pid_g >= first) & (pid_g < first + groups)
        sl = tl.where(mine, s, sl)
        n0 = tl.where(mine, c_lo + (pid_g - first) * GROUP_N, n0)
        n_end = tl.where(mine, c_hi, n_end)
        first = first + groups
    return sl, n0, n_end


@triton.jit
def base_tile(out_rows, bias_ptr, n, tile_mask, nmask, stride_on, HAS_BIAS: tl.constexpr):
    """A stacked GEMM's base output for a tile (+ bias), in float32: an expand's accumulator start."""
    acc = tl.load(out_rows + n[None, :] * stride_on, mask=tile_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    return acc
