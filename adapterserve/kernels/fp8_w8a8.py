"""W8A8 FP8 GEMM for decode batches (Triton): e4m3 activations (one float32 scale per
token) times e4m3 weights (one float32 scale per output channel).

Semantics: ``y[m, n] = x_scale[m] * w_scale[n] * sum_k float(xq[m, k]) * float(w[n, k])``,
accumulated in float32, stored in ``out_dtype``: what torch._scaled_mm with row-wise
scales computes. Narrow outputs split K over several programs so the grid fills the GPU;
each split writes a float32 partial tile and the last one to finish a tile (a per-tile
counter) sums the partials in split order, so results do not depend on timing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapterserve.kernels.split_counters import prepare_split_counters, sms_of, split_counters, split_span

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class W8A8Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def choose_w8a8_config(m: int, n: int, k: int, sms: int, block_n: int | None = None,
                       block_k: int | None = None, split_k: int | None = None) -> W8A8Config:
    """Tiles for an [m, k] x [k, n] product on a GPU with ``sms`` multiprocessors: one
    row block for decode batches, narrow column tiles for narrow outputs, and split-K
    until about two programs run per multiprocessor (each split keeping >= 4 K blocks).
    Any of block_n, block_k, split_k given overrides the choice (benchmark sweeps)."""
    block_m = min(max(16, triton.next_power_of_2(m)), 64)
    block_n = block_n or (64 if n <= 8192 else 128)
    block_k = block_k or (256 if k >= 8192 else 128)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        split_k = 1
        while split_k < 16 and tiles * split_k * 2 <= 2 * sms and k // (block_k * split_k * 2) >= 4:
            split_k *= 2
    stages = 3 if block_n * block_k >= 128 * 256 else 4
    return W8A8Config(block_m, block_n, block_k, split_k, num_stages=stages)


@triton.jit
def _w8a8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                 stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk
        x = tl.load(xq_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < k_end),
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < k_end),
                    other=0.0)
        acc = tl.dot(x, w, acc)
    x_scale = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:  # the tile's last split sums
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(SPLIT_K):
                total += tl.load(part_ptr + split * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0)  # ready for the next call (and graph replay)


def prepare_w8a8(device: torch.device | str) -> None:
    """Allocate the device's split-K tile counters before CUDA-graph capture."""
    prepare_split_counters(device)


def fp8_w8a8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, config: W8A8Config | None = None) -> torch.Tensor:
    """xq: [M, K] float8_e4m3fn (rows contiguous), x_scale: [M, 1] or [M] float32, weight: [N, K]
    float8_e4m3fn, w_scale: [N] float32 -> y [M, N] in out_dtype (see the module's semantics)."""
    m, k = xq.shape
    n = weight.shape[0]
    if config is None:
        config = choose_w8a8_config(m, n, k, sms_of(xq.device))
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    if grid[0] * grid[1] > split_counters(xq.device).numel():
        raise ValueError(f"fp8_w8a8_linear: {grid[0] * grid[1]} output tiles exceed the counters; use larger tiles")
    k_per_split = split_span(k, config.split_k, config.block_k)
    partials = (torch.empty(config.split_k, m, n, dtype=torch.float32, device=xq.device) if config.split_k > 1
                else y)
    _w8a8_kernel[grid](xq, x_scale, weight, w_scale, y, partials, split_counters(xq.device), m, n, k, k_per_split,
                       xq.stride(0), weight.stride(0), y.stride(0),
                       BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                       SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return y
