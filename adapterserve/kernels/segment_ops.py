"""Launchers for the segment kernels: block shapes from host ints, then one launch.

``seg_down`` and ``seg_up`` are the two GEMMs behind LoRA shrink/expand and the
bottleneck adapter. Decode-sized batches (``use_gemv``) run the CUDA-core kernels of
``segment_gemv`` (one program per token), the rest the tensor-core kernels of
``segment_gemm`` (one program per tile of a slot's tokens). The choice and the grids
depend only on shapes, never on device values, so every launch can be captured in a
CUDA graph. The block-shape constants were picked by ``benchmarks/lora_kernels.py --sweep``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.pdl import pdl_args
from adapterserve.kernels.segment_common import ACT_BY_SLOT, ACT_CODES, MAX_SLICES
from adapterserve.kernels.segment_gemm import seg_down_dot, seg_up_dot
from adapterserve.kernels.segment_gemv import seg_down_gemv, seg_up_gemv

# CUDA-core kernels for at most GEMV_TOKENS tokens of pools whose ranks are at most
# GEMV_MAX_RANK. Both CUDA-core kernels cost each token its own adapter's rank, so the
# choice must not hinge on the pool's largest rank: an engine configured for rank 64 and
# serving rank-16 adapters would otherwise decode on the tensor-core kernels, which leave
# a decode batch's one token per 16-row tile (BENCHMARKS.md, LoRA kernels).
GEMV_TOKENS = 256
GEMV_MAX_RANK = 64
GEMV_UP_RANKS = 16  # rank rows per step of the CUDA-core expand
GEMV_UP_COLUMNS = 2048  # most columns of one CUDA-core expand program


@dataclass(frozen=True)
class DownConfig:
    """seg_down blocks. rows: packed rank rows per program (0: block_r); gemv: CUDA-core kernel."""

    block_r: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    rows: int = 0
    gemv: bool = False


@dataclass(frozen=True)
class UpConfig:
    """seg_up blocks: a program adds group_n (0: block_n) columns of one slice, block_n at a time."""

    block_r: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    group_n: int = 0
    gemv: bool = False


GEMV_DOWN = DownConfig(block_r=0, block_k=1024, num_warps=4, num_stages=1, rows=4, gemv=True)
# rows longer than GEMV_WIDE_K (down_proj's intermediate sizes: 11008, 14336, ...): chunks and warps
# doubled, half the steps along K per program; faster there, slower on 4096-wide rows (BENCHMARKS.md,
# "The decode LoRA chain on its own"). Rows of 8192 (a 1B's down_proj, a 70B's q|k|v) keep the default.
GEMV_WIDE_K = 8192
GEMV_DOWN_WIDE = DownConfig(block_r=0, block_k=2048, num_warps=8, num_stages=1, rows=4, gemv=True)
GEMV_UP_ELEMS = 16384  # rank rows x columns of B one CUDA-core expand step holds
GEMV_UP_WARPS = 4
DOT_DOWN_LANES = 64  # most packed rank rows one tensor-core shrink program covers
DOT_UP_RANKS = 64  # rank rows per step of the tensor-core expand (larger ranks loop)


def dot_down_config(packed_cols: int, on_gpu: bool) -> DownConfig:
    """Tensor-core shrink blocks: one program covers up to 64 packed rank rows."""
    block_r = min(DOT_DOWN_LANES, max(16, triton.next_power_of_2(packed_cols)))
    if not on_gpu:
        return DownConfig(block_r=block_r, block_k=64)
    return DownConfig(block_r=block_r, block_k=128 if block_r <= 32 else 64, num_stages=4)


def dot_up_config(max_rank: int, on_gpu: bool) -> UpConfig:
    """Tensor-core expand blocks: 128 columns at a time, 512 per program."""
    block_r = min(DOT_UP_RANKS, max(16, triton.next_power_of_2(max_rank)))
    return UpConfig(block_r=block_r, block_n=128, group_n=512) if on_gpu else UpConfig(block_r, 32, group_n=64)


def use_gemv(num_tokens: int, max_rank: int) -> bool:
    """Whether a layer's shrink and expand run the CUDA-core kernels (host ints only)."""
    return num_tokens <= GEMV_TOKENS and max_rank <= GEMV_MAX_RANK


def gemv_down_config(k: int) -> DownConfig:
    """CUDA-core shrink blocks on a GPU for rows of k elements."""
    return GEMV_DOWN_WIDE if k > GEMV_WIDE_K else GEMV_DOWN


def down_config(meta: AdapterBatchMeta, n_slices: int, max_rank: int, on_gpu: bool, k: int) -> DownConfig:
    """Block shape for seg_down from host ints only (k: the input width)."""
    if use_gemv(meta.num_tokens, max_rank):
        return gemv_down_config(k) if on_gpu else DownConfig(block_r=0, block_k=128, rows=16, gemv=True)
    return dot_down_config(n_slices * max_rank, on_gpu)


def up_config(meta: AdapterBatchMeta, max_rank: int, on_gpu: bool) -> UpConfig:
    """Block shape for seg_up from host ints only."""
    if use_gemv(meta.num_tokens, max_rank):
        block_r = min(GEMV_UP_RANKS, triton.next_power_of_2(max(max_rank, 2)))
        if not on_gpu:
            return UpConfig(block_r=block_r, block_n=64, gemv=True)
        return UpConfig(block_r, min(GEMV_UP_COLUMNS, GEMV_UP_ELEMS // block_r), num_warps=GEMV_UP_WARPS, gemv=True)
    return dot_up_config(max_rank, on_gpu)


def _pow2_align(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (0 divides by anything)."""
    align = 16
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_tiles(meta: AdapterBatchMeta) -> None:
    if meta.tile_slots is None or meta.tile_starts is None or meta.tile_ends is None:
        raise ValueError("AdapterBatchMeta has no tile list: build it with build_adapter_meta()")
    if meta.block_m < 16 or meta.block_m & (meta.block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16 for the Triton kernels, got {meta.block_m}")


def _tiles(meta: AdapterBatchMeta) -> tuple:
    return meta.sorted_tokens, meta.tile_slots, meta.tile_starts, meta.tile_ends


def seg_down(
    x: torch.Tensor,
    a: torch.Tensor,
    a_slot_stride: int,
    rank: torch.Tensor,
    row_start: torch.Tensor | None,
    meta: AdapterBatchMeta,
    out: torch.Tensor,
    max_rank: int,
    bias: torch.Tensor | None = None,
    activation: str | torch.Tensor = "none",
    config: DownConfig | None = None,
    mixed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Packed-rank down-projection over slot tiles.

    x: [T, K]; a: [n_slices, rows, K] (a row of slot `slot` lives at
    slot * a_slot_stride + row_start[s, slot] + r); rank, row_start: [n_slices, S];
    out: [n_slices, T, >= max_rank]; bias: [S, >= max_rank] (one slice only);
    activation: a name of ACT_CODES, or [S] int32 codes of ACT_CODES, one per slot;
    mixed: (residual [T, K], mix [S]): the input is x[t] + mix[slot] * residual[t] (the
    CUDA-core kernel only: ``use_gemv``).
    Semantics: out[s, t, r] = act(x[t] @ a[s, row(slot[t], r)] + bias[slot, r]), r < rank[s, slot].
    """
    _check_tiles(meta)
    n_slices, t, k = a.shape[0], x.shape[0], x.shape[1]
    if t == 0 or meta.max_tiles == 0:
        return
    cfg = config or down_config(meta, n_slices, max_rank, x.is_cuda, k)
    if mixed is not None and (not cfg.gemv or mixed[0].shape != x.shape):
        raise ValueError(f"a mixed input (x + mix * residual) needs the CUDA-core shrink (use_gemv) and a residual "
                         f"like x {tuple(x.shape)}, got {tuple(mixed[0].shape)}")
    rows = cfg.rows or cfg.block_r
    by_slot = isinstance(activation, torch.Tensor)
    args = (
        x, a, out, bias if bias is not None else out, activation if by_slot else rank, rank,
        row_start if row_start is not None else rank, *_tiles(meta), k, max_rank,
        x.stride(0), x.stride(1), a.stride(0), a_slot_stride, a.stride(1), a.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        rank.stride(0), rank.stride(1), bias.stride(0) if bias is not None else 0,
    )
    flags = dict(
        NUM_SLICES=n_slices, HAS_ROW_START=row_start is not None, HAS_BIAS=bias is not None,
        ACT=ACT_BY_SLOT if by_slot else ACT_CODES[activation], A_ALIGN=_pow2_align(a.stride(0), a_slot_stride, a.stride(1)),
    )
    grid = (meta.max_tiles, triton.cdiv(n_slices * max_rank, rows))
    if cfg.gemv:
        gemv_args = args[:7] + (meta.token_slots,) + args[11:]
        grid = (t, grid[1])
        seg_down_gemv[grid](*gemv_args, **flags, ROWS=rows, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=1,
                            **pdl_args(x), **_mixed_args(mixed))
        return
    seg_down_dot[grid](
        *args, **flags, EVEN_K=k % cfg.block_k == 0, DOT_PRECISION=_precision(a.dtype),
        BLOCK_M=meta.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, ROWS=rows,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _mixed_args(mixed: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
    """seg_down_gemv's arguments of a mixed input (x + mix[slot] * residual), none without one."""
    if mixed is None:
        return {}
    residual, mix = mixed
    if mix.dim() != 1 or mix.stride(0) != 1:
        raise ValueError(f"mix must be one contiguous value per slot, got {tuple(mix.shape)}")
    return dict(res_ptr=residual, mix_ptr=mix, stride_rest=residual.stride(0), stride_resk=residual.stride(1),
                HAS_MIX=1)


def seg_up(
    v: torch.Tensor,
    b: torch.Tensor,
    b_slot_stride: int,
    rank: torch.Tensor,
    row_start: torch.Tensor | None,
    col_offsets: tuple[int, ...],
    meta: AdapterBatchMeta,
    y: torch.Tensor,
    max_rank: int,
    bias: torch.Tensor | None = None,
    config: UpConfig | None = None,
) -> None:
    """Up-projection over slot tiles, added into y.

    v: [n_slices, T, >= max_rank]; b: [rows, N] (row of slot `slot` at
    slot * b_slot_stride + row_start[s, slot] + r); col_offsets: n_slices + 1
    host ints; y: [T, N]; bias: [S, N].
    Semantics: y[t, c_s:c_s1] += v[s, t, :r] @ b[rows(slot[t]), c_s:c_s1] + bias[slot].
    """
    _check_tiles(meta)
    n_slices = len(col_offsets) - 1
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"{n_slices} slices in one launch; at most {MAX_SLICES} are supported")
    if y.shape[0] == 0 or meta.max_tiles == 0:
        return
    cfg = config or up_config(meta, max_rank, y.is_cuda)
    group = cfg.block_n if cfg.gemv else max(cfg.group_n, cfg.block_n) // cfg.block_n * cfg.block_n
    widths = [col_offsets[s + 1] - col_offsets[s] for s in range(n_slices)]
    grid = (meta.max_tiles, sum(triton.cdiv(w, group) for w in widths))
    c = list(col_offsets[1:]) + [0] * (MAX_SLICES - n_slices)
    args = (
        v, b, y, bias if bias is not None else y, rank, row_start if row_start is not None else rank,
        *_tiles(meta), max_rank, *c,
        v.stride(0), v.stride(1), v.stride(2), b_slot_stride, b.stride(0), b.stride(1),
        y.stride(0), y.stride(1), rank.stride(0), rank.stride(1), bias.stride(0) if bias is not None else 0,
    )
    flags = dict(
        NUM_SLICES=n_slices, HAS_ROW_START=row_start is not None, HAS_BIAS=bias is not None,
        N_ALIGN=_pow2_align(cfg.block_n, group, *col_offsets),
    )
    if cfg.gemv:
        gemv_args = args[:6] + (meta.token_slots,) + args[10:]
        seg_up_gemv[(y.shape[0], grid[1])](
            *gemv_args, **flags, BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=1,
            **pdl_args(y),
        )
        return
    seg_up_dot[grid](
        *args, **flags, DOT_PRECISION=_precision(b.dtype), ONE_R=max_rank <= cfg.block_r,
        BLOCK_M=meta.block_m, BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, GROUP_N=group,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
