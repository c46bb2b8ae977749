"""Grouped Triton expand for the stacked layout: tokens grouped by adapter, as the segmented expand.

Grid axis 0 walks the tile list of ``AdapterBatchMeta`` (up to ``block_m`` tokens of one
slot per tile), then tiles of the tokens without adapter; axis 1 walks column groups of
every slice. An adapter tile reads its tokens' shrink straight from the stacked GEMM's
output (pool row r of slice s at column N + r * n_slices + s), its own B rows once per
column group, and writes base + bias + update; a tile of tokens without adapter writes
base + bias. Each program reads one adapter's rows, so a step's B traffic is its distinct
adapters' rows, whatever their count; one launch per linear.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.pdl import pdl_args, pdl_wait
from adapterserve.kernels.segment_common import MAX_SLICES, base_tile, slice_group, tile_tokens
from adapterserve.kernels.stacked import GroupedTiles, check_stacked, grouped_tiles


@triton.jit
def _adapter_tile(
    out_ptr, b_ptr, y_ptr, bias_ptr, rank_ptr, row_start_ptr, sorted_ptr, tile_slots_ptr, tile_starts_ptr,
    tile_ends_ptr, pid, sl, n0, n_end, n_out, rows, max_rank,
    stride_ot, stride_on, stride_br, stride_bn, stride_yt, stride_yn, stride_rs, stride_rslot,
    NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, ONE_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """base + bias + v @ B for a tile of one slot's tokens, GROUP_N columns from n0 (a
    padding tile past the last one has no tokens: every access masked off)."""
    slot, tok, tmask = tile_tokens(tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, sorted_ptr, pid, BLOCK_M)
    safe = tl.maximum(slot, 0)
    rank = tl.minimum(tl.load(rank_ptr + sl * stride_rs + safe * stride_rslot), max_rank)
    row0 = tl.load(row_start_ptr + sl * stride_rs + safe * stride_rslot)
    rank = tl.where(slot >= 0, tl.maximum(tl.minimum(rank, rows - row0), 0), 0)  # never past the GEMM's rows
    pdl_wait(USE_PDL)  # the tile's metadata read before the wait, the GEMM's output after it
    out_rows = out_ptr + tok[:, None] * stride_ot
    y_rows = y_ptr + tok[:, None] * stride_yt
    r = tl.arange(0, BLOCK_R)
    if ONE_R:  # every rank fits one block: the tile's shrink loaded once for the whole group
        rmask = r < rank
        prow = (row0 + r).to(tl.int64)
        v = tl.load(out_rows + (n_out + prow * NUM_SLICES + sl)[None, :] * stride_on,
                    mask=tmask[:, None] & rmask[None, :], other=0.0)
    for step in range(0, GROUP_N, BLOCK_N):
        n = n0 + step + tl.arange(0, BLOCK_N)
        nmask = n < n_end
        tile_mask = tmask[:, None] & nmask[None, :]
        acc = base_tile(out_rows, bias_ptr, n, tile_mask, nmask, stride_on, HAS_BIAS)
        if ONE_R:
            b = tl.load(b_ptr + prow[:, None] * stride_br + n[None, :] * stride_bn,
                        mask=rmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(v, b, acc, input_precision=DOT_PRECISION)
        else:
            for r0 in range(0, rank, BLOCK_R):
                rr = r0 + r
                rmask2 = rr < rank
                prow2 = (row0 + rr).to(tl.int64)
                v2 = tl.load(out_rows + (n_out + prow2 * NUM_SLICES + sl)[None, :] * stride_on,
                             mask=tmask[:, None] & rmask2[None, :], other=0.0)
                b2 = tl.load(b_ptr + prow2[:, None] * stride_br + n[None, :] * stride_bn,
                             mask=rmask2[:, None] & nmask[None, :], other=0.0)
                acc = tl.dot(v2, b2, acc, input_precision=DOT_PRECISION)
        tl.store(y_rows + n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit
def _plain_tile(
    out_ptr, y_ptr, bias_ptr, sorted_ptr, slot_starts_ptr, tile, n0, n_end, stride_ot, stride_on, stride_yt,
    stride_yn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr,
):
    """base + bias for tile `tile` of the tokens without adapter (sorted first: positions
    [0, slot_starts[0]); a tile past them has no tokens: every access masked off)."""
    pos = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tmask = pos < tl.load(slot_starts_ptr)
    tok = tl.load(sorted_ptr + pos, mask=tmask, other=0).to(tl.int64)
    out_rows = out_ptr + tok[:, None] * stride_ot
    y_rows = y_ptr + tok[:, None] * stride_yt
    for step in range(0, GROUP_N, BLOCK_N):
        n = n0 + step + tl.arange(0, BLOCK_N)
        nmask = n < n_end
        tile_mask = tmask[:, None] & nmask[None, :]
        acc = base_tile(out_rows, bias_ptr, n, tile_mask, nmask, stride_on, HAS_BIAS)
        tl.store(y_rows + n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit(do_not_specialize=["num_tiles", "rows"])
def _grouped_expand_kernel(
    out_ptr, b_ptr, y_ptr, bias_ptr, rank_ptr, row_start_ptr,
    sorted_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, slot_starts_ptr,
    num_tiles, n_out, rows, max_rank, c1, c2, c3, c4,
    stride_ot, stride_on, stride_br, stride_bn, stride_yt, stride_yn, stride_rs, stride_rslot,
    NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, ONE_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    sl, n0, n_end = slice_group(tl.program_id(1), c1, c2, c3, c4, NUM_SLICES, GROUP_N)
    if pid < num_tiles:
        _adapter_tile(out_ptr, b_ptr, y_ptr, bias_ptr, rank_ptr, row_start_ptr, sorted_ptr, tile_slots_ptr,
                      tile_starts_ptr, tile_ends_ptr, pid, sl, n0, n_end, n_out, rows, max_rank,
                      stride_ot, stride_on, stride_br, stride_bn, stride_yt, stride_yn, stride_rs, stride_rslot,
                      NUM_SLICES, HAS_BIAS, DOT_PRECISION, ONE_R, BLOCK_M, BLOCK_R, BLOCK_N, GROUP_N, USE_PDL)
    else:
        pdl_wait(USE_PDL)
        _plain_tile(out_ptr, y_ptr, bias_ptr, sorted_ptr, slot_starts_ptr, pid - num_tiles, n0, n_end,
                    stride_ot, stride_on, stride_yt, stride_yn, HAS_BIAS, BLOCK_M, BLOCK_N, GROUP_N)


def stacked_expand_grouped(out: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor,
                           bias: torch.Tensor | None = None, tiles: GroupedTiles | None = None) -> None:
    """The layer output from a stacked GEMM's output, one launch (semantics of
    ``reference.stacked_expand``). ``tiles``: the constexprs, ``grouped_tiles``' choice
    unless given (benchmarks compare others). ``meta`` needs its tile list."""
    rows = check_stacked(out, lora, meta, y, bias)
    num_tokens, n_slices = y.shape[0], lora.num_slices
    if meta.tile_slots is None or meta.block_m < 16 or meta.block_m & (meta.block_m - 1):
        raise ValueError("the grouped expand needs a tile list of a power-of-two block_m >= 16 "
                         "(build the meta with build_adapter_meta)")
    if num_tokens == 0:
        return
    if meta.num_slots < 1:
        raise ValueError("the grouped expand needs at least one adapter slot")
    if lora.b.dtype != out.dtype:
        raise ValueError(f"B ({lora.b.dtype}) and the stacked GEMM's output ({out.dtype}) must share a dtype")
    offs = lora.out_offsets
    tiles = tiles or grouped_tiles(lora.max_rank)
    group = max(tiles.group_n, tiles.block_n) // tiles.block_n * tiles.block_n
    groups = sum(triton.cdiv(offs[s + 1] - offs[s], group) for s in range(n_slices))
    c = list(offs[1:]) + [0] * (MAX_SLICES - n_slices)
    grid = (meta.max_tiles + triton.cdiv(num_tokens, meta.block_m), groups)
    _grouped_expand_kernel[grid](
        out, lora.b, y, bias if bias is not None else y, lora.rank, lora.row_start,
        meta.sorted_tokens, meta.tile_slots, meta.tile_starts, meta.tile_ends, meta.slot_starts,
        meta.max_tiles, offs[-1], rows, lora.max_rank, *c,
        out.stride(0), out.stride(1), lora.b.stride(0), lora.b.stride(1), y.stride(0), y.stride(1),
        lora.rank.stride(0), lora.rank.stride(1),
        NUM_SLICES=n_slices, HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if out.dtype == torch.float32 else "tf32",
        ONE_R=lora.max_rank <= tiles.block_r, BLOCK_M=meta.block_m, BLOCK_R=tiles.block_r,
        BLOCK_N=tiles.block_n, GROUP_N=group, num_warps=tiles.warps, **pdl_args(y),
    )
