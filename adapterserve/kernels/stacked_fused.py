"""The stacked LoRA linear of a decode step in one launch: base GEMM, shrink and expand.

One Triton grid over two sets of rows, split over K like the decode GEMM
(kernels/decode_gemm.py): the A rows of a window of pool rows per slice (from the lowest row
the step's tokens use there, so idle adapters below or above cost nothing), then the weight's
rows, tiled per slice (kernels/stacked.py: both in one [W; A] buffer, or the A rows apart). A shrink
tile stores the tokens' shrink values and counts itself done. A base tile, once its K sum
is whole, waits until every shrink tile is done, then adds its tokens' updates as the
tiled expand does (kernels/stacked_tiled.py: a tensor-core dot per 16 pool rows its
tokens use) and stores the layer output. The expand costs no launch of its own, and its
base output never goes through memory in bf16.

The shrink tiles come first in the grid and a GPU starts a grid's programs in order, so a
base tile waits only for programs already running (with PDL the next kernel launches only
once every program of this one has started, so its waiting programs cannot crowd them out).
The last base tile resets the two step counters for the next call (and graph replay).

A weight in the activations' dtype shares one K loop with the A rows. An e4m3 weight (kept
apart: it cannot share a buffer with bf16 A rows, ``BaseApart``) is read either against the
activations' per-token e4m3 rounding (W8A8, as fp8_decode_gemm) or against the activations
themselves (weight-only, the weight widened chunk by chunk); its base sum takes its row and
column scales before the update is added. Its shrink tiles then run a K loop of their own on
the unrounded activations, as the separate kernels do (``ShrinkTiles``: sized to fit shared
memory beside the base loop, and split finer over K, as they read twice the bytes per column).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapterserve.kernels.decode_gemm import FP8, MAX_ROWS, DecodeGemmConfig, row_tile, split_for
from adapterserve.kernels.decode_loop import k_loop, prefetch_rows, scaled, split_total
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.pdl import pdl_args, pdl_wait
from adapterserve.kernels.segment_common import MAX_SLICES, slice_group
from adapterserve.kernels.split_counters import COUNTERS, INDEX_LIMIT, sms_of, split_counters, split_span
from adapterserve.kernels.stacked import StackedWeight
from adapterserve.kernels.stacked_tiled import (
    CHUNK,
    _b_rows,
    _chunk_dot,
    _chunk_rows,
    _dot,
    _shrink_rows,
    token_rows,
)

STEP_COUNTERS = 2  # shrink tiles done, base tiles done: after the tile counters


@dataclass(frozen=True)
class BaseApart:
    """The base weight of a linear whose A rows are stored apart, and how its product runs.

    weight:       [N, K] in the activations' dtype, or float8_e4m3fn
    weight_scale: [N] float32, one per output channel of an e4m3 weight (else None)
    quantized:    for an e4m3 weight, the activations rounded per token (e4m3 [T, K], float32
                  scales [T] or [T, 1]): W8A8; None: weight-only (the activations in their dtype)
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor | None = None
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class ShrinkTiles:
    """How the shrink tiles of a launch run their K loop.

    block_k: K chunk of a loop of their own (0: they share the base tiles' loop, one dtype)
    stages:  its pipeline stages
    split:   K splits of a shrink tile (its programs: a share of the activations each)
    """

    block_k: int
    stages: int
    split: int


@triton.jit
def _wait_for(flag_ptr, target):
    """Spin until the counter at flag_ptr reaches target (acquire: the writes counted are seen)."""
    done = tl.atomic_add(flag_ptr, 0, sem="acquire")
    while done < target:
        done = tl.atomic_add(flag_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _window_bases(rank_ptr, row_start_ptr, slots_ptr, t, tmask, sl, cols, rows, pool_rows, stride_rs, stride_rslot,
                  NUM_SLICES: tl.constexpr):
    """The first pool row of each slice's window of ``rows`` rows: the lowest row of that slice any
    token of the tile uses, lowered where the window would pass the pool's end (reference.window_bases).
    Returns slice sl's and, per column of shrink values (pool row r of slice s at r * NUM_SLICES + s),
    its slice's."""
    slot = tl.load(slots_ptr + t, mask=tmask, other=-1)
    safe = tl.maximum(slot, 0)
    own = 0
    per_column = tl.zeros_like(cols)
    for s in tl.static_range(NUM_SLICES):
        rank = tl.load(rank_ptr + s * stride_rs + safe * stride_rslot)
        row0 = tl.load(row_start_ptr + s * stride_rs + safe * stride_rslot)
        lo = tl.min(tl.where((slot >= 0) & (rank > 0), row0, pool_rows), axis=0)
        base = tl.maximum(tl.minimum(lo, pool_rows - rows), 0)
        own = tl.where(sl == s, base, own)
        per_column = tl.where(cols % NUM_SLICES == s, base, per_column)
    return own, per_column


@triton.jit
def _expand(acc, s_rows, s_shift, b_ptr, b_first, row0, end, lo, hi, n, nmask, sl, stride_br, stride_bn,
            NUM_SLICES: tl.constexpr, IEEE: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """acc + each token's update on columns n of slice sl (the tiled expand's walk); b_first:
    the B rows of the first chunk, loaded earlier; s_shift: the shrink column of pool row 0 (the
    shrink values begin at the window's first row)."""
    if lo < hi:
        rr, uses, row_used = _chunk_rows(lo, row0, end, CHUNK_ROWS)
        acc = _dot(acc, _shrink_rows(s_rows, rr, uses, s_shift, sl, 1, NUM_SLICES), b_first, IEEE)
    for r0 in range(lo + CHUNK_ROWS, hi, CHUNK_ROWS):
        rr, uses, row_used = _chunk_rows(r0, row0, end, CHUNK_ROWS)
        if tl.max(row_used.to(tl.int32), axis=0) > 0:
            acc = _chunk_dot(acc, s_rows, b_ptr, rr, uses, row_used, n, nmask, s_shift, sl,
                             1, stride_br, stride_bn, NUM_SLICES, IEEE)
    return acc


@triton.jit
def _columns(pid, a_tiles, a_width, c1, c2, c3, c4, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr,
             SPLIT_K: tl.constexpr, SPLIT_A: tl.constexpr, ALIGNED: tl.constexpr):
    """Program pid's tile: whether it is a shrink tile (the first a_tiles * SPLIT_A programs),
    its index among its kind, its K split, its slice and its columns (of the shrink values, which
    are its A rows, or of the output, which are its weight rows)."""
    is_shrink = pid < a_tiles * SPLIT_A
    base_pid = pid - a_tiles * SPLIT_A
    tile = tl.where(is_shrink, pid // SPLIT_A, base_pid // SPLIT_K)
    pid_k = tl.where(is_shrink, pid % SPLIT_A, base_pid % SPLIT_K)
    sl, n0, n_end = slice_group(tile, c1, c2, c3, c4, NUM_SLICES, BLOCK_N)
    col0 = tl.where(is_shrink, tile * BLOCK_N, n0)
    if ALIGNED:  # every slice starts at a multiple of 16: say so, for vector stores
        col0 = tl.multiple_of(col0, 16)
    cols = col0 + tl.arange(0, BLOCK_N)
    n_mask = cols < tl.where(is_shrink, a_width, n_end)
    return is_shrink, tile, pid_k, sl, cols, n_mask


# rows stays specialised: its divisibility by 16 saves the tiles' registers (the engine's fused pools keep
# every row bucket a multiple of 16, config.FUSED_ROW_ALIGN); M and a_tiles vary from step to step
@triton.jit(do_not_specialize=["M", "a_tiles"])
def _stacked_fused_kernel(
    x_ptr, w_ptr, y_ptr, s_ptr, part_ptr, part_a_ptr, count_ptr, b_ptr, bias_ptr, rank_ptr, row_start_ptr,
    slots_ptr, xb_ptr, a_ptr, xs_ptr, ws_ptr, M, K, k_per_split, a_k_per_split, n_out, rows, pool_rows, max_rank,
    a_tiles, b_tiles,
    c1, c2, c3, c4, stride_xm, stride_wn, stride_ym, stride_sm, stride_br, stride_bn, stride_rs, stride_rslot,
    stride_xbm, stride_an,
    NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, HAS_LORA: tl.constexpr, ALIGNED: tl.constexpr, SPLIT_A: tl.constexpr = 1,
    A_BLOCK_K: tl.constexpr = 0, A_STAGES: tl.constexpr = 0, BASE_IEEE: tl.constexpr = 0, X_SCALED: tl.constexpr = 0,
    W_SCALED: tl.constexpr = 0, USE_PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0,
):
    a_width = rows * NUM_SLICES
    is_shrink, tile, pid_k, sl, cols, n_mask = _columns(
        tl.program_id(0), a_tiles, a_width, c1, c2, c3, c4, NUM_SLICES, BLOCK_N, SPLIT_K, SPLIT_A, ALIGNED)
    rm = tl.arange(0, BLOCK_M)
    span = tl.where(is_shrink, a_k_per_split, k_per_split)
    k_start = pid_k * span
    k_end = tl.minimum(k_start + span, K)
    a_cols = cols  # a shrink tile's A rows: its columns, each moved to its slice's window
    if HAS_LORA:  # the windows, the tokens' rows and the first chunk of B: no activation, before the wait
        base, column_base = _window_bases(rank_ptr, row_start_ptr, slots_ptr, rm, rm < M, sl, cols, rows, pool_rows,
                                          stride_rs, stride_rslot, NUM_SLICES)
        a_cols = cols + column_base * NUM_SLICES
        row0, end, lo, hi = token_rows(rank_ptr, row_start_ptr, slots_ptr, rm, rm < M, sl, base + rows, max_rank,
                                        stride_rs, stride_rslot)
        hi = tl.where(is_shrink, lo, hi)  # a shrink tile's columns are no B columns: it reads none
        rr, uses, row_used = _chunk_rows(lo, row0, end, CHUNK_ROWS)
        b_first = _b_rows(b_ptr, rr, row_used & (rr < hi), cols, n_mask, stride_br, stride_bn)
    w_rows = w_ptr + cols[:, None] * stride_wn
    # an output tile's weight rows (a shrink tile's A rows are few and shared: not asked for)
    prefetch_rows(w_rows, w_ptr, n_mask & (is_shrink == 0), k_start, k_end, BLOCK_K, PREFETCH)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if not HAS_LORA:  # no shrink tiles: the (rounded) activations against the weight
        acc = k_loop(acc, xb_ptr + rm[:, None] * stride_xbm, w_rows, rm, M, n_mask, k_start, k_end, BLOCK_K,
                     NUM_STAGES, BASE_IEEE)
    elif A_STAGES > 0:  # an e4m3 base: a K loop (and shared memory) of its own for the shrink tiles
        if is_shrink:
            acc = k_loop(acc, x_ptr + rm[:, None] * stride_xm, a_ptr + a_cols[:, None] * stride_an, rm, M, n_mask,
                         k_start, k_end, A_BLOCK_K, A_STAGES, IEEE)
        else:
            acc = k_loop(acc, xb_ptr + rm[:, None] * stride_xbm, w_rows, rm, M, n_mask, k_start, k_end, BLOCK_K,
                         NUM_STAGES, BASE_IEEE)
    else:  # a weight in the activations' dtype: one K loop over each tile's own rows
        # the base and stride chosen as scalars: a choice between two pointer tensors hides their alignment
        # from Triton 3.9's pipeliner, which then loads the weight rows synchronously (tests/kernels/pipeline_ptx.py)
        tile_rows = tl.where(is_shrink, a_cols, cols)
        rows_of_tile = (tl.where(is_shrink, a_ptr, w_ptr)
                        + tile_rows[:, None] * tl.where(is_shrink, stride_an, stride_wn))
        acc = k_loop(acc, x_ptr + rm[:, None] * stride_xm, rows_of_tile, rm, M, n_mask, k_start, k_end, BLOCK_K,
                     NUM_STAGES, IEEE)
    out_mask = (rm[:, None] < M) & n_mask[None, :]
    step = count_ptr + a_tiles + b_tiles  # shrink tiles done, then base tiles past their wait
    if is_shrink:
        total, last = split_total(acc, part_a_ptr, count_ptr + tile, pid_k, rm, cols, out_mask, M, a_width, SPLIT_A)
        if last:
            tl.store(s_ptr + rm[:, None] * stride_sm + cols[None, :], total.to(s_ptr.dtype.element_ty),
                     mask=out_mask)
            tl.debug_barrier()
            tl.atomic_add(step, 1, sem="release")
    else:
        total, last = split_total(acc, part_ptr, count_ptr + a_tiles + tile, pid_k, rm, cols, out_mask, M, n_out,
                                  SPLIT_K)
        if last:
            total = scaled(total, xs_ptr, ws_ptr, rm, cols, n_mask, M, X_SCALED, W_SCALED)
            if HAS_LORA:
                _wait_for(step, a_tiles)
                total = _expand(total, s_ptr + rm[:, None] * stride_sm, -base * NUM_SLICES, b_ptr, b_first, row0, end,
                                lo, hi, cols, n_mask, sl, stride_br, stride_bn, NUM_SLICES, IEEE, CHUNK_ROWS)
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * stride_ym + cols[None, :], total.to(y_ptr.dtype.element_ty),
                     mask=out_mask)
            if HAS_LORA:
                # a base tile counts itself past its wait; the last one resets both counters (relaxed:
                # the count follows the wait it depends on, and the next call starts after this one ends)
                if tl.atomic_add(step + 1, 1, sem="relaxed") == b_tiles - 1:
                    tl.atomic_xchg(step, 0, sem="relaxed")
                    tl.atomic_xchg(step + 1, 0, sem="relaxed")


def stacked_fused(x: torch.Tensor, stacked: StackedWeight, lora: LoraSlices, meta: AdapterBatchMeta, rows: int,
                  bias: torch.Tensor | None = None, config: DecodeGemmConfig | None = None,
                  apart: BaseApart | None = None, shrink: ShrinkTiles | None = None) -> torch.Tensor:
    """x: [T, K] (T <= 64) -> the layer output [T, N]: x @ W.T + each token's own LoRA update
    from a window of ``rows`` pool rows per slice that begins at the lowest row the tokens use
    there (reference.window_bases; semantics of a GEMM over the windows' A rows then
    reference.stacked_expand from the windows' first rows), one launch. B has the LoRA scaling
    folded in; tokens with slot -1 get the base output. With
    ``apart`` (a buffer of A rows only), W is its weight: an e4m3 one's product is
    fp8_decode_gemm's (W8A8 on the rounded activations, or weight-only). shrink: the shrink
    tiles' K loop (default: shrink_tiles'). With rows 0 the launch has base tiles only."""
    m, k = x.shape
    n_slices, offs, n_out = lora.num_slices, lora.out_offsets, stacked.n_out
    _check(x, stacked, lora, rows, bias)
    base_x, x_scale, weight, weight_scale = _base_operands(x, stacked, apart)
    config = config or DecodeGemmConfig()
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    a_width = rows * n_slices
    a_tiles = triton.cdiv(a_width, config.block_n)
    b_tiles = sum(triton.cdiv(offs[s + 1] - offs[s], config.block_n) for s in range(n_slices))
    split = split_for(n_out + a_width, k, config, sms_of(x.device))
    if a_tiles + b_tiles + STEP_COUNTERS > COUNTERS:
        raise ValueError(f"stacked_fused: {a_tiles + b_tiles} tiles exceed the counters; use wider tiles")
    s = torch.empty(m, max(a_width, 1), dtype=x.dtype, device=x.device)
    partials = torch.empty(split, m, n_out, dtype=torch.float32, device=x.device) if split > 1 else y
    c = list(offs[1:]) + [0] * (MAX_SLICES - n_slices)
    a_rows = stacked.a_rows()
    block_m = row_tile(m)
    if rows == 0:  # base tiles only
        shrink, partials_a = ShrinkTiles(0, 0, 1), s  # no program reads partials_a
    else:
        shrink = shrink or shrink_tiles(config, block_m, split, k, x.element_size(), base_x.element_size(),
                                        weight.element_size(), shared_memory_of(x.device))
        partials_a = torch.empty(shrink.split, m, a_width, dtype=torch.float32, device=x.device)
    _stacked_fused_kernel[(a_tiles * shrink.split + b_tiles * split,)](
        x, weight, y, s, partials, partials_a, split_counters(x.device), lora.b, bias if bias is not None else y,
        lora.rank, lora.row_start, meta.token_slots, base_x, a_rows, y if x_scale is None else x_scale,
        y if weight_scale is None else weight_scale, m, k, split_span(k, split, config.block_k),
        split_span(k, shrink.split, shrink.block_k or config.block_k), n_out, rows, stacked.pool_rows, lora.max_rank,
        a_tiles, b_tiles,
        *c,
        x.stride(0), weight.stride(0), y.stride(0), s.stride(0), lora.b.stride(0), lora.b.stride(1),
        lora.rank.stride(0), lora.rank.stride(1), base_x.stride(0), a_rows.stride(0),
        NUM_SLICES=n_slices, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, NUM_STAGES=config.num_stages, CHUNK_ROWS=CHUNK, HAS_LORA=rows > 0,
        ALIGNED=all(o % 16 == 0 for o in offs), SPLIT_A=shrink.split, A_BLOCK_K=shrink.block_k, A_STAGES=shrink.stages,
        BASE_IEEE=base_x.dtype == torch.float32, X_SCALED=int(x_scale is not None),
        W_SCALED=int(weight_scale is not None), num_warps=config.num_warps,
        **pdl_args(x, prefetch=True))
    return y


def finer_split(split: int, factor: int, k: int, block_k: int) -> int:
    """split times factor, halved until each split has at least two K chunks (never below split)."""
    finer = split * factor
    while finer > split and k < block_k * finer * 2:
        finer //= 2
    return finer


SHRINK_SPLIT_PER_BYTE_RATIO = 2  # K splits of a shrink tile per (its bytes per K column / a base tile's)
SHRINK_MAX_STAGES = 3


def shrink_tiles(config: DecodeGemmConfig, block_m: int, split: int, k: int, x_size: int, base_x_size: int,
                 weight_size: int, shared_memory: int) -> ShrinkTiles:
    """The shrink tiles' K loop, from the element sizes of the activations, of what the base
    tiles read and of the weight. One dtype: the base tiles' loop and split. An e4m3 base
    needs a loop of its own: chunks of the base chunk's bytes, at most SHRINK_MAX_STAGES
    stages, fewer where both loops' buffers would pass ``shared_memory`` bytes. A shrink tile
    reads more bytes per K column than a base tile (bf16 activations against e4m3 ones) and the
    base tiles wait for it, so it takes more K splits (benchmarks/fp8_lora_fused.py --sweep:
    with twice its bytes ratio, the least tax of the loops swept on an H200)."""
    if base_x_size == x_size == weight_size:
        return ShrinkTiles(0, 0, split)
    block_k = max(16, config.block_k * weight_size // x_size)
    shrink_bytes = (block_m + config.block_n) * x_size  # per K column
    base_bytes = block_m * base_x_size + config.block_n * weight_size
    split_a = finer_split(split, SHRINK_SPLIT_PER_BYTE_RATIO * -(-shrink_bytes // base_bytes), k, block_k)
    stages, base_buffers = min(config.num_stages, SHRINK_MAX_STAGES), config.num_stages * config.block_k * base_bytes
    while stages > 1 and base_buffers + stages * block_k * shrink_bytes > shared_memory:
        stages -= 1
    return ShrinkTiles(block_k, stages, split_a)


@functools.cache
def shared_memory_of(device: torch.device) -> int:
    """Bytes of shared memory one program may use (what Triton checks at launch); unbounded off CUDA."""
    if device.type != "cuda":
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def _base_operands(x: torch.Tensor, stacked: StackedWeight, apart: BaseApart | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """What the base tiles read: (activations, their row scales, weight, its channel scales)."""
    if stacked.joint:
        if apart is not None:
            raise ValueError("stacked_fused: a [W; A] buffer holds its weight; apart is for A rows kept apart")
        return x, None, stacked.weight(), None
    if apart is None:
        raise ValueError("stacked_fused: this buffer holds A rows only; pass the weight kept apart")
    weight, scale = apart.weight, apart.weight_scale
    if weight.dtype not in (x.dtype, FP8) or weight.shape != (stacked.n_out, x.shape[1]) or weight.stride(1) != 1:
        raise ValueError(f"stacked_fused: the weight kept apart must be {x.dtype} or {FP8} [{stacked.n_out}, "
                         f"{x.shape[1]}] with contiguous rows, got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[0] * weight.stride(0) >= INDEX_LIMIT:
        raise ValueError("stacked_fused: the weight's offsets need 64 bits; this kernel indexes in 32")
    if weight.dtype != FP8:
        if scale is not None or apart.quantized is not None:
            raise ValueError("stacked_fused: scales and rounded activations go with an e4m3 weight only")
        return x, None, weight, None
    if scale is None or scale.dtype != torch.float32 or scale.numel() != stacked.n_out:
        raise ValueError(f"stacked_fused: the e4m3 weight needs {stacked.n_out} float32 channel scales, got "
                         f"{None if scale is None else (scale.numel(), scale.dtype)}")
    if apart.quantized is None:
        return x, None, weight, scale.contiguous()
    q, q_scale = apart.quantized
    if q.dtype != FP8 or q.shape != x.shape or q.stride(1) != 1 or q_scale.numel() != x.shape[0]:
        raise ValueError(f"stacked_fused: the rounded activations must be {FP8} {tuple(x.shape)} with one scale "
                         f"per row, got {q.dtype} {tuple(q.shape)} and {q_scale.numel()} scales")
    return q, q_scale.reshape(-1).float().contiguous(), weight, scale.contiguous()


def _check(x: torch.Tensor, stacked: StackedWeight, lora: LoraSlices, rows: int, bias: torch.Tensor | None) -> None:
    m, k = x.shape
    if m > MAX_ROWS or stacked.buffer.shape[1] != k or x.stride(1) != 1 or stacked.buffer.stride(1) != 1:
        raise ValueError(f"stacked_fused: x {tuple(x.shape)} and the buffer {tuple(stacked.buffer.shape)} need "
                         f"T <= {MAX_ROWS}, one K and contiguous rows")
    if stacked.buffer.shape[0] * stacked.buffer.stride(0) >= INDEX_LIMIT:
        raise ValueError("stacked_fused: the buffer's offsets need 64 bits; this kernel indexes in 32")
    if not 0 <= rows <= stacked.pool_rows:
        raise ValueError(f"rows must be in [0, {stacked.pool_rows}], got {rows}")
    if lora.out_offsets[-1] != stacked.n_out or lora.num_slices != stacked.n_slices:
        raise ValueError("stacked_fused: the pool's slices do not match the stacked weight's")
    if lora.num_slices > MAX_SLICES:
        raise ValueError(f"{lora.num_slices} slices in one launch; at most {MAX_SLICES} are supported")
    if lora.b.dtype != x.dtype or stacked.buffer.dtype != x.dtype:
        raise ValueError(f"B ({lora.b.dtype}), the A rows ({stacked.buffer.dtype}) and x ({x.dtype}) must share "
                         "a dtype")
    if bias is not None and bias.shape != (stacked.n_out,):
        raise ValueError(f"bias must be [N={stacked.n_out}], got {tuple(bias.shape)}")
