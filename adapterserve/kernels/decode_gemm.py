"""A decode GEMM of our own (Triton): ``y = x @ w.T`` for a decode batch (M <= 64 rows):
one row tile, narrow column tiles, split over K until the grid gives each multiprocessor
about ``waves`` programs, the K loop software-pipelined. It launches with programmatic
dependent launch when that is on (kernels/pdl.py). Its loop and split-K sum are shared
with the fused stacked LoRA linear (kernels/stacked_fused.py), which is why it exists:
cuBLAS cannot take the LoRA update into its launch.

FP8 weights (float8_e4m3fn, one float32 scale per output channel) run through the same
loop (``fp8_decode_gemm``): with activations in bf16/f16/f32 each weight chunk is widened
to their dtype before its dot (weight-only); with e4m3 activations (one float32 scale per
row) the dot takes both in e4m3 (W8A8, what torch._scaled_mm with row-wise scales computes).
The scales multiply the finished sum.

Each split writes a float32 partial tile; the last split to finish a tile (a per-tile
counter) sums the partials in split order, so results do not depend on timing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapterserve.kernels.decode_loop import k_loop, prefetch_rows, split_total, store_scaled
from adapterserve.kernels.pdl import pdl_args, pdl_wait
from adapterserve.kernels.split_counters import INDEX_LIMIT, sms_of, split_counters, split_span

MAX_ROWS = 64  # the largest decode batch a launch takes
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class DecodeGemmConfig:
    block_n: int = 32
    block_k: int = 128
    split_k: int = 0  # 0: chosen so that about `waves` programs run per multiprocessor
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 2


def row_tile(m: int) -> int:
    """The row tile (BLOCK_M) a launch of m rows compiles with: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


WIDE = 16384  # output columns from which a program takes 128 of them (gate|up)


def decode_config(n: int, k: int) -> DecodeGemmConfig:
    """Tiles for a [<=64, k] x [k, n] decode product: 32 columns a program, 4 pipeline stages;
    128 columns and 3 stages for wide outputs (the fastest in benchmarks/decode_gemm.py's
    sweep over the 8B's projections)."""
    if n >= WIDE:
        return DecodeGemmConfig(block_n=128, block_k=128, num_stages=3)
    return DecodeGemmConfig(block_n=32, block_k=128, num_stages=4)


def fp8_decode_config(n: int, k: int) -> DecodeGemmConfig:
    """Tiles for a decode product on e4m3 weights (fp8_decode_gemm): K chunks of 256 (the
    bytes of a bf16 chunk of 128); 32 columns and 4 stages, 64 columns and 3 stages for wide
    outputs (the fastest W8A8 tiles in benchmarks/fp8_decode_gemm.py on the 8B's projections)."""
    if n >= WIDE:
        return DecodeGemmConfig(block_n=64, block_k=256, num_stages=3)
    return DecodeGemmConfig(block_n=32, block_k=256, num_stages=4)


def fp8_fused_config(n: int, k: int) -> DecodeGemmConfig:
    """Tiles for the fused LoRA linear on e4m3 weights (kernels/stacked_fused.py): the decode
    product's, but 128 columns, K chunks of 128 and 8 warps for wide outputs (gate|up), where
    64-column tiles' LoRA epilogue costs more than their K loop saves (benchmarks/fused_tiles.py)."""
    if n >= WIDE:
        return DecodeGemmConfig(block_n=128, block_k=128, num_stages=3, num_warps=8)
    return fp8_decode_config(n, k)


def split_for(n: int, k: int, config: DecodeGemmConfig, sms: int) -> int:
    """config.split_k, or the split that brings the grid nearest `waves` programs per
    multiprocessor while each split keeps at least two K chunks."""
    if config.split_k:
        return config.split_k
    tiles, split = triton.cdiv(n, config.block_n), 1
    while tiles * split * 2 <= config.waves * sms and k // (config.block_k * split * 2) >= 2:
        split *= 2
    return split


@triton.jit
def _decode_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, xs_ptr, ws_ptr, M, N, K, k_per_split,
                        stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, IEEE: tl.constexpr,
                        X_SCALED: tl.constexpr = 0, W_SCALED: tl.constexpr = 0, USE_PDL: tl.constexpr = 0,
                        PREFETCH: tl.constexpr = 0):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rn[:, None] * stride_wn
    prefetch_rows(w_rows, w_ptr, n_mask, k_start, k_end, BLOCK_K, PREFETCH)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = k_loop(acc, x_ptr + rm[:, None] * stride_xm, w_rows, rm, M, n_mask, k_start, k_end, BLOCK_K, NUM_STAGES,
                 IEEE)
    out_mask = (rm[:, None] < M) & n_mask[None, :]
    total, last = split_total(acc, part_ptr, count_ptr + pid_n, pid_k, rm, rn, out_mask, M, N, SPLIT_K)
    if last:
        store_scaled(total, y_ptr, xs_ptr, ws_ptr, rm, rn, n_mask, out_mask, M, stride_ym, X_SCALED, W_SCALED)


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, config: DecodeGemmConfig | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 64, rows contiguous), weight: [N, K] (rows contiguous) -> y [M, N] in
    x's dtype, accumulated in float32 (``out``, if given, receives it)."""
    return _launch(x, weight, None, None, x.dtype, config or decode_config(*weight.shape), out)


def fp8_decode_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                    config: DecodeGemmConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight: [N, K] float8_e4m3fn with weight_scale [N] float32. x: [M, K] (M <= 64) either
    in bf16/f16/f32 (weight-only: y in x's dtype) or float8_e4m3fn with x_scale [M] or [M, 1]
    float32 (W8A8: y in out_dtype). y = x_scale * (x @ weight.T) * weight_scale, summed in float32
    (``out``, if given, receives it)."""
    if weight.dtype != FP8 or weight_scale.numel() != weight.shape[0]:
        raise ValueError(f"fp8_decode_gemm: weight must be {FP8} with one scale per row, got {weight.dtype} "
                         f"{tuple(weight.shape)} and {weight_scale.numel()} scales")
    if (x.dtype == FP8) != (x_scale is not None) or (x.dtype == FP8 and out_dtype is None):
        raise ValueError("fp8_decode_gemm: e4m3 activations need their row scales and an out_dtype; others neither")
    if x_scale is not None and x_scale.numel() != x.shape[0]:
        raise ValueError(f"fp8_decode_gemm: {x_scale.numel()} row scales for {x.shape[0]} rows")
    x_scale = None if x_scale is None else x_scale.reshape(-1).contiguous()
    return _launch(x, weight, x_scale, weight_scale.contiguous(), out_dtype or x.dtype,
                   config or fp8_decode_config(*weight.shape), out)


def _launch(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor | None, weight_scale: torch.Tensor | None,
            out_dtype: torch.dtype, config: DecodeGemmConfig, out: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"decode_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} need M <= {MAX_ROWS}, "
                         "one K and contiguous rows")
    if weight.shape[0] * weight.stride(0) >= INDEX_LIMIT:
        raise ValueError("decode_gemm: the weight's offsets need 64 bits; this kernel indexes in 32")
    y = torch.empty(m, n, dtype=out_dtype, device=x.device) if out is None else out
    split = split_for(n, k, config, sms_of(x.device))
    grid = (triton.cdiv(n, config.block_n), split)
    counters = split_counters(x.device)
    if grid[0] > counters.numel():
        raise ValueError(f"decode_gemm: {grid[0]} output tiles exceed the counters; use wider tiles")
    k_per_split = split_span(k, split, config.block_k)
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _decode_gemm_kernel[grid](x, weight, y, partials, counters, _or(x_scale, y), _or(weight_scale, y), m, n, k,
                              k_per_split, x.stride(0), weight.stride(0), y.stride(0),
                              BLOCK_M=row_tile(m), BLOCK_N=config.block_n,
                              BLOCK_K=config.block_k, SPLIT_K=split, NUM_STAGES=config.num_stages,
                              IEEE=x.dtype == torch.float32, X_SCALED=int(x_scale is not None),
                              W_SCALED=int(weight_scale is not None), num_warps=config.num_warps,
                              **pdl_args(x, prefetch=True))
    return y


def _or(scale: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """A scale argument, or any tensor in its place when the kernel reads none."""
    return stand_in if scale is None else scale
