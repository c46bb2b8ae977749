"""Tiled Triton expand for the stacked layout: base output plus each token's own LoRA update.

One program per (BLOCK_M tokens, BLOCK_N columns of one slice). Its accumulator starts
from the tokens' base output (+ bias); it then walks the pool rows its tokens use in
chunks of 16: a chunk no token of the tile uses is skipped, otherwise the tokens' shrink
values of those rows (zero where a token does not use a row) times the chunk's B rows
go through one tensor-core dot. B is read once per token tile, so a decode step reads
each active adapter's B rows once per column tile; one launch per linear. Without the
branch (ExpandTiles.skip_unused off) every chunk in the tile's row range is a masked
load, and the loop can be software-pipelined.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.pdl import pdl_args, pdl_wait
from adapterserve.kernels.segment_common import MAX_SLICES, base_tile, slice_group
from adapterserve.kernels.stacked import ExpandTiles, check_stacked, expand_tiles

CHUNK = 16  # pool rows per dot: the smallest K a tensor-core dot takes


@triton.jit
def _chunk_rows(r0, row0, end, CHUNK_ROWS: tl.constexpr):
    """Pool rows r0 .. r0 + CHUNK_ROWS: the rows, which of them each token of the tile uses
    [BLOCK_M, CHUNK] and which any token uses [CHUNK]."""
    rr = r0 + tl.arange(0, CHUNK_ROWS)
    uses = (rr[None, :] >= row0[:, None]) & (rr[None, :] < end[:, None])
    row_used = tl.max(uses.to(tl.int32), axis=0) > 0
    return rr, uses, row_used


@triton.jit
def token_rows(rank_ptr, row_start_ptr, slots_ptr, t, tmask, sl, rows, max_rank, stride_rs, stride_rslot):
    """Each token's pool rows [row0, end) on slice sl (empty without adapter, never past the
    GEMM's rows), and the range [lo, hi) any of them uses."""
    slot = tl.load(slots_ptr + t, mask=tmask, other=-1)
    safe = tl.maximum(slot, 0)
    rank = tl.minimum(tl.load(rank_ptr + sl * stride_rs + safe * stride_rslot), max_rank)
    row0 = tl.load(row_start_ptr + sl * stride_rs + safe * stride_rslot)
    end = tl.where(slot >= 0, tl.minimum(row0 + rank, rows), row0)
    used = end > row0
    lo = tl.min(tl.where(used, row0, rows), axis=0)
    hi = tl.max(tl.where(used, end, 0), axis=0)
    return row0, end, lo, hi


@triton.jit
def _b_rows(b_ptr, rr, row_used, n, nmask, stride_br, stride_bn):
    """Those rows of B (zero where no token of the tile uses one: a row being written or
    freed is never read)."""
    prow = rr.to(tl.int64)
    return tl.load(b_ptr + prow[:, None] * stride_br + n[None, :] * stride_bn,
                   mask=row_used[:, None] & nmask[None, :], other=0.0)


@triton.jit
def _shrink_rows(out_rows, rr, uses, n_out, sl, stride_on, NUM_SLICES: tl.constexpr):
    """The tile's shrink values of pool rows rr (zero where a token does not use a row)."""
    prow = rr.to(tl.int64)
    return tl.load(out_rows + (n_out + prow * NUM_SLICES + sl)[None, :] * stride_on, mask=uses, other=0.0)


@triton.jit
def _dot(acc, s, b, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(s, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(s, b, acc)
    return acc


@triton.jit
def _chunk_dot(acc, out_rows, b_ptr, rr, uses, row_used, n, nmask, n_out, sl, stride_on, stride_br, stride_bn,
               NUM_SLICES: tl.constexpr, IEEE: tl.constexpr):
    """acc + the tile's shrink values of pool rows rr times those rows of B."""
    s = _shrink_rows(out_rows, rr, uses, n_out, sl, stride_on, NUM_SLICES)
    return _dot(acc, s, _b_rows(b_ptr, rr, row_used, n, nmask, stride_br, stride_bn), IEEE)


@triton.jit
def _first_chunk_after_wait(out_rows, bias_ptr, b_ptr, lo, hi, row0, end, n, nmask, tile_mask, n_out, sl,
                            stride_on, stride_br, stride_bn, NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr,
                            IEEE: tl.constexpr, CHUNK_ROWS: tl.constexpr, USE_PDL: tl.constexpr):
    """The PDL order: the tile's first chunk of B rows before the wait; after it the base
    output (+ bias) and that chunk's dot, as the loop would add it. Returns the accumulator
    and the loop's next row (the first chunk holds row lo, used by a token: never skipped)."""
    rr, uses, row_used = _chunk_rows(lo, row0, end, CHUNK_ROWS)
    b = _b_rows(b_ptr, rr, row_used, n, nmask, stride_br, stride_bn)
    pdl_wait(USE_PDL)
    acc = base_tile(out_rows, bias_ptr, n, tile_mask, nmask, stride_on, HAS_BIAS)
    if lo < hi:
        acc = _dot(acc, _shrink_rows(out_rows, rr, uses, n_out, sl, stride_on, NUM_SLICES), b, IEEE)
    return acc, lo + CHUNK_ROWS


@triton.jit(do_not_specialize=["num_tokens", "rows"])
def _tiled_expand_kernel(
    out_ptr, b_ptr, y_ptr, bias_ptr, rank_ptr, row_start_ptr, slots_ptr,
    num_tokens, n_out, rows, max_rank, c1, c2, c3, c4,
    stride_ot, stride_on, stride_br, stride_bn, stride_yt, stride_yn, stride_rs, stride_rslot,
    NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr, SKIP_UNUSED: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    sl, n0, n_end = slice_group(tl.program_id(1), c1, c2, c3, c4, NUM_SLICES, BLOCK_N)
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < n_end
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tmask = t < num_tokens
    out_rows = out_ptr + t.to(tl.int64)[:, None] * stride_ot
    tile_mask = tmask[:, None] & nmask[None, :]
    if not USE_PDL:
        acc = base_tile(out_rows, bias_ptr, n, tile_mask, nmask, stride_on, HAS_BIAS)
    row0, end, lo, hi = token_rows(rank_ptr, row_start_ptr, slots_ptr, t, tmask, sl, rows, max_rank, stride_rs,
                                   stride_rslot)
    first = lo
    if USE_PDL:
        acc, first = _first_chunk_after_wait(out_rows, bias_ptr, b_ptr, lo, hi, row0, end, n, nmask, tile_mask,
                                             n_out, sl, stride_on, stride_br, stride_bn, NUM_SLICES, HAS_BIAS,
                                             IEEE, CHUNK_ROWS, USE_PDL)
    for r0 in range(first, hi, CHUNK_ROWS):
        rr, uses, row_used = _chunk_rows(r0, row0, end, CHUNK_ROWS)
        if SKIP_UNUSED:
            if tl.max(row_used.to(tl.int32), axis=0) > 0:
                acc = _chunk_dot(acc, out_rows, b_ptr, rr, uses, row_used, n, nmask, n_out, sl,
                                 stride_on, stride_br, stride_bn, NUM_SLICES, IEEE)
        else:
            acc = _chunk_dot(acc, out_rows, b_ptr, rr, uses, row_used, n, nmask, n_out, sl,
                             stride_on, stride_br, stride_bn, NUM_SLICES, IEEE)
    y_rows = y_ptr + t.to(tl.int64)[:, None] * stride_yt
    tl.store(y_rows + n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=tile_mask)


def stacked_expand_tiled(out: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor,
                         bias: torch.Tensor | None = None, tiles: ExpandTiles | None = None) -> None:
    """The layer output from a stacked GEMM's output, one launch (semantics of
    ``reference.stacked_expand``). ``tiles``: the constexprs, ``expand_tiles``' choice
    unless given (benchmarks compare others)."""
    rows = check_stacked(out, lora, meta, y, bias)
    num_tokens, n_slices = y.shape[0], lora.num_slices
    if num_tokens == 0:
        return
    if lora.b.dtype != out.dtype:
        raise ValueError(f"B ({lora.b.dtype}) and the stacked GEMM's output ({out.dtype}) must share a dtype")
    offs = lora.out_offsets
    tiles = tiles or expand_tiles(num_tokens, offs[-1])
    groups = sum(triton.cdiv(offs[s + 1] - offs[s], tiles.block_n) for s in range(n_slices))
    c = list(offs[1:]) + [0] * (MAX_SLICES - n_slices)
    grid = (triton.cdiv(num_tokens, tiles.block_m), groups)
    _tiled_expand_kernel[grid](
        out, lora.b, y, bias if bias is not None else y, lora.rank, lora.row_start, meta.token_slots,
        num_tokens, offs[-1], rows, lora.max_rank, *c,
        out.stride(0), out.stride(1), lora.b.stride(0), lora.b.stride(1), y.stride(0), y.stride(1),
        lora.rank.stride(0), lora.rank.stride(1),
        NUM_SLICES=n_slices, HAS_BIAS=bias is not None, IEEE=out.dtype == torch.float32,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CHUNK_ROWS=CHUNK, SKIP_UNUSED=tiles.skip_unused,
        num_warps=tiles.warps, num_stages=tiles.stages, **pdl_args(y),
    )
