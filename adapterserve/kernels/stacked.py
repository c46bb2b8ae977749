"""The stacked layout: a linear's LoRA A rows as extra output rows of its base weight.

One buffer [N + pool_rows * n_slices, K] holds the base weight W (rows 0..N, the
layer's weight is a view of them: no second copy) and then the A rows of every
slot, pool row by pool row, slices interleaved: pool row r of slice s is buffer row
N + r * n_slices + s. The first ``rows`` pool rows of all slices are then one
contiguous range, so a single GEMM over ``buffer[: N + rows * n_slices]`` yields the
base output and every adapter's shrink at once (``stacked_gemm``); the expand reads
each token's own columns of that output (``ops.stacked_expand``). Two expands, chosen per
step from the step's distinct adapters (``choose_expand``, a host int): the tiled one
(kernels/stacked_tiled.py: a token tile walks the rows its tokens use, best with few
adapters) and the grouped one (kernels/stacked_grouped.py: a program per adapter's
tokens, best with many). Their tiles come from ``expand_tiles`` / ``grouped_tiles``,
host-only choosers warm-up calls too.

With lora_decode="fused" a linear keeps its weight apart from its A rows instead (a buffer of
A rows only, ``stack_apart``): a step of at most FUSED_MAX_ADAPTERS adapters whose row bucket
is at most ``fused_max_rows`` runs GEMM, shrink and expand in one launch on both
(kernels/stacked_fused.py, layers/fused_lora.py), the others the separate shrink and expand on
the A rows (faster than the stacked GEMM and its expand from a few adapters on, and than the
fused linear over many rows, BENCHMARKS.md). An FP8 weight is always kept apart.

``rows`` is a host int from a few sizes (``row_bucket``): a CUDA graph captures one
GEMM shape per size. A [W; A] GEMM covers pool rows [0, rows), so adapters placed in the low
rows keep it short; the fused linear covers a window of ``rows`` rows per slice from the
step's lowest row there (LoraPool.for_step buckets the span of the step's adapters).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta

MIN_ROW_BUCKET = 16
STACKED_MAX_TOKENS = 256  # larger batches (prefill) keep the segmented kernels
FUSED_MAX_TOKENS = 64  # the fused linear's steps: at most this many tokens (decode_gemm.MAX_ROWS) ...
FUSED_MAX_ADAPTERS = 2  # ... over at most this many distinct adapters (each adds a dot to every tile's tail)
# ... whose row bucket is at most this many pool rows, by the weight's bytes per value: the fused linear's
# shrink reads every row of the bucket of its adapters' span, the separate kernels only the step's adapters'
# (fused_linear_projections.py --resident on an H200: bf16 fused wins at 128 rows and loses at 256, FP8 wins
# at 16 and loses at 128; its 64 is between them, not measured)
FUSED_MAX_ROWS = {1: 64, 2: 128, 4: 128}
MAX_SLICES = 4  # as segment_common.MAX_SLICES: slices one expand launch covers
# a step whose tokens use at least this many distinct adapters runs the grouped expand, fewer the
# tiled one (benchmarks/fused_update.py prints the crossover)
GROUPED_MIN_ADAPTERS = 8
EXPAND_KERNELS = ("tiled", "grouped")  # the expands that follow a stacked GEMM (ops.stacked_expand)
EXPANDS = (*EXPAND_KERNELS, "fused")  # a step's choices


@dataclass(frozen=True)
class ExpandTiles:
    """Constexprs of one tiled stacked-expand launch (a Triton compile variant)."""

    block_m: int  # tokens per program
    block_n: int  # output columns per program (of one slice)
    warps: int
    skip_unused: bool = True  # branch over row chunks no token of the tile uses (else masked loads)
    stages: int = 1  # software-pipelined stages of the row-chunk loop (> 1 only without the branch)


def expand_tiles(num_tokens: int, n_out: int) -> ExpandTiles:
    """The tiled expand's tiles for a step of num_tokens rows over a linear of n_out
    columns: the shortest token tile that holds the step (a decode step is one M-tile,
    so B rows are read once), wider column tiles only where the columns give programs
    enough for every SM."""
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_n = 128 if n_out >= 16384 else 64
    return ExpandTiles(block_m, block_n, 8 if block_m * block_n >= 8192 else 4)


@dataclass(frozen=True)
class GroupedTiles:
    """Constexprs of one grouped stacked-expand launch (a Triton compile variant; its token
    tile is the meta's block_m)."""

    block_r: int  # rank rows per dot (larger ranks loop)
    block_n: int  # output columns per dot
    group_n: int  # output columns per program, block_n at a time
    warps: int = 4


def grouped_tiles(max_rank: int) -> GroupedTiles:
    """The grouped expand's tiles for a pool of ranks up to max_rank: one dot covers the
    ranks up to 64, 128 columns at a time, 512 per program."""
    return GroupedTiles(min(64, max(16, 1 << max(max_rank - 1, 0).bit_length())), 128, 512)


def fused_max_rows(weight_dtype: torch.dtype) -> int:
    """The largest row bucket a step of the fused linear covers over weights of this dtype."""
    return FUSED_MAX_ROWS[torch.empty((), dtype=weight_dtype).element_size()]


def choose_expand(distinct_adapters: int, num_tokens: int = 1, fused_rows: int = 0, rows: int = 0) -> str:
    """The expand a step runs from its count of distinct adapters and of tokens: "tiled" or
    "grouped" after a stacked GEMM (lora_decode="stacked"); with ``fused_rows`` (lora_decode="fused",
    A rows kept apart: the largest row bucket the fused linear covers, 0 for none) "fused", the
    whole linear in one launch (kernels/stacked_fused.py), for few adapters in a row bucket
    ``rows`` of at most fused_rows, or for the steps it does not take the separate shrink and
    expand, named "tiled"."""
    if fused_rows:
        few = distinct_adapters <= FUSED_MAX_ADAPTERS and num_tokens <= FUSED_MAX_TOKENS and rows <= fused_rows
        return "fused" if few else "tiled"
    return "grouped" if distinct_adapters >= GROUPED_MIN_ADAPTERS else "tiled"


def reads_row_bucket(expand: str | None, fused_rows: int) -> bool:
    """Whether a step's LoRA reads the stacked GEMMs' row bucket: always with the [W; A] layout;
    with the fused linear's pool (A rows kept apart) only in the fused linear's steps (the separate
    kernels its other steps run read none), so their CUDA graphs need not be keyed by it."""
    return not fused_rows or expand == "fused"


def expand_for_slots(slots: Sequence[int] | np.ndarray, fused_rows: int = 0, num_tokens: int | None = None,
                     rows: int = 0) -> str:
    """choose_expand for a step's per-token adapter slots (host values, -1: none); num_tokens:
    the rows the step's kernels see, when not one per slot (a graph's bucket); rows: the step's
    row bucket."""
    values = np.asarray(slots)
    return choose_expand(len(np.unique(values[values >= 0])), len(values) if num_tokens is None else num_tokens,
                         fused_rows, rows)


def reachable_expands(num_tokens: int, num_slots: int, fused_rows: int = 0, max_requests: int | None = None,
                      rows: int = 0) -> tuple[str, ...]:
    """The expands a step of num_tokens rows over num_slots adapter slots can choose in row
    bucket ``rows`` (its distinct adapters: at most one per row, or per request where
    max_requests bounds them)."""
    most = min(num_tokens if max_requests is None else max_requests, num_tokens, num_slots)
    chosen = {choose_expand(n, num_tokens, fused_rows, rows) for n in range(1, most + 1)}
    return tuple(e for e in EXPANDS if e in chosen)


@dataclass
class RowsInUse:
    """Pool rows the stacked GEMMs cover (a row bucket; 0 = none in use). Shared by every
    stacked linear of an engine, written by the LoRA pool as adapters come and go.
    fused_rows: steps with few adapters in a row bucket of at most this many rows run the fused
    linear (lora_decode="fused": fused_max_rows of the weights; 0 for none)."""

    rows: int = 0
    fused_rows: int = 0

    @property
    def fused(self) -> bool:
        """Whether the linears keep their weights apart from the A rows for the fused linear."""
        return self.fused_rows > 0


@dataclass
class StackedWeight:
    """One linear's [W; A] buffer, or its A rows alone where W is stored apart (lora_decode="fused":
    the fused linear reads both, the separate kernels the A rows; always for an FP8 weight, whose
    e4m3 rows cannot share a buffer with the adapters' bf16 rows).

    buffer:     [N + pool_rows * n_slices, K], or [pool_rows * n_slices, K] when not ``joint``
    n_out:      N, the base output width
    n_slices:   projections fused in the linear
    rows_in_use: the shared row bucket
    joint:      whether W's rows head the buffer
    """

    buffer: torch.Tensor
    n_out: int
    n_slices: int
    rows_in_use: RowsInUse
    joint: bool = True

    @property
    def a_start(self) -> int:
        """The buffer row where the A rows begin."""
        return self.n_out if self.joint else 0

    @property
    def pool_rows(self) -> int:
        return (self.buffer.shape[0] - self.a_start) // self.n_slices

    def weight(self) -> torch.Tensor:
        """[N, K] the base weight (a view)."""
        if not self.joint:
            raise ValueError("this stacked buffer holds A rows only: its linear keeps its weight apart")
        return self.buffer[: self.n_out]

    def a_rows(self) -> torch.Tensor:
        """[pool_rows * n_slices, K]: pool row r of slice s at row r * n_slices + s."""
        return self.buffer[self.a_start :]

    def lora_a(self) -> torch.Tensor:
        """[n_slices, pool_rows, K] the A pool (a strided view, LoraSlices.a's layout)."""
        k = self.buffer.shape[1]
        return self.a_rows().view(self.pool_rows, self.n_slices, k).transpose(0, 1)


def stack_weight(weight: torch.Tensor, n_slices: int, pool_rows: int, rows_in_use: RowsInUse) -> StackedWeight:
    """A new [W; A] buffer holding a copy of ``weight`` [N, K] and zeroed A rows."""
    n_out, k = weight.shape
    buffer = torch.zeros(n_out + pool_rows * n_slices, k, dtype=weight.dtype, device=weight.device)
    buffer[:n_out].copy_(weight)
    return StackedWeight(buffer, n_out, n_slices, rows_in_use)


def stack_apart(weight: torch.Tensor, n_slices: int, pool_rows: int, rows_in_use: RowsInUse, dtype: torch.dtype
                ) -> StackedWeight:
    """Zeroed A rows in the adapters' ``dtype`` for a weight [N, K] kept apart."""
    n_out, k = weight.shape
    buffer = torch.zeros(pool_rows * n_slices, k, dtype=dtype, device=weight.device)
    return StackedWeight(buffer, n_out, n_slices, rows_in_use, joint=False)


def row_bucket(high_water: int, pool_rows: int) -> int:
    """Rows a stacked GEMM covers so pool rows [0, high_water) are in: a power of two
    (at least MIN_ROW_BUCKET), at most pool_rows; 0 when no row is in use."""
    if high_water <= 0:
        return 0
    if high_water > pool_rows:
        raise ValueError(f"rows in use ({high_water}) exceed the pool's {pool_rows} rows")
    bucket = MIN_ROW_BUCKET
    while bucket < high_water:
        bucket *= 2
    return min(bucket, pool_rows)


def stacked_gemm(x: torch.Tensor, stacked: StackedWeight, rows: int) -> torch.Tensor:
    """x: [T, K] -> [T, N + rows * n_slices]: the base output, then every slot's shrink
    of pool rows [0, rows) (column N + r * n_slices + s holds x @ A_s[r])."""
    if not 0 <= rows <= stacked.pool_rows:
        raise ValueError(f"rows must be in [0, {stacked.pool_rows}], got {rows}")
    if not stacked.joint:
        raise ValueError("stacked_gemm needs W and A in one buffer; this linear keeps its weight apart")
    return F.linear(x, stacked.buffer[: stacked.n_out + rows * stacked.n_slices])


def check_stacked(out: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor,
                  bias: torch.Tensor | None) -> int:
    """Shape checks shared with the twin; returns the rows the stacked GEMM covered."""
    n, n_slices = lora.out_offsets[-1], lora.num_slices
    if y.dim() != 2 or y.shape != (meta.num_tokens, n):
        raise ValueError(f"y must be [T={meta.num_tokens}, N={n}], got {tuple(y.shape)}")
    extra = out.shape[1] - n if out.dim() == 2 else -1
    if out.dim() != 2 or out.shape[0] != y.shape[0] or extra < 0 or extra % n_slices:
        raise ValueError(
            f"out must be [T={y.shape[0]}, N + rows * {n_slices}] with N={n}, got {tuple(out.shape)}"
        )
    if extra // n_slices > lora.b.shape[0]:
        raise ValueError(f"out covers {extra // n_slices} pool rows, the pool has {lora.b.shape[0]}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}")
    if n_slices > MAX_SLICES:
        raise ValueError(f"{n_slices} slices in one launch; at most {MAX_SLICES} are supported")
    return extra // n_slices
