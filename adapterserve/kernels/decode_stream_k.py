"""Stream-K launches of the decode GEMM (``DecodeGemmConfig(stream_k=True)``): a fixed number
of programs (``waves`` a multiprocessor) share the product's K chunks equally, whatever the
number of output tiles. A split-K grid of T tiles x S splits leaves a tail when T x S is not
a multiple of the programs the GPU runs at once (the 8B's q|k|v at B=64: 192 tiles for 264
places); here every program reads the same number of weight bytes.

Units are (tile, K chunk) pairs in tile-major order; program p takes units
[p U / P, (p + 1) U / P). A tile whose chunks one program holds is stored at once; a tile
shared by several programs is summed by the last of them to finish, from float32 partials
in the order of its programs, so results do not depend on timing (as in decode_gemm).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from adapterserve.kernels.decode_loop import k_loop, store_scaled, sum_in_slot_order
from adapterserve.kernels.pdl import pdl_args, pdl_wait
from adapterserve.kernels.split_counters import INDEX_LIMIT, sms_of, split_counters


@triton.jit
def _first_program(unit, units, programs):
    """The program whose share holds ``unit``."""
    return ((unit + 1) * programs + units - 1) // units - 1


@triton.jit
def _shared_tile_total(acc, part_ptr, count_ptr, tile, pid, units, chunks, programs, rm, cols, out_mask, M, N):
    """A shared tile's sum, and whether this program holds it: each program stores its partial in
    its slot (its rank among the tile's programs); the last to finish sums the slots in order."""
    first = _first_program(tile * chunks, units, programs)
    sharers = _first_program((tile + 1) * chunks - 1, units, programs) - first + 1
    return sum_in_slot_order(acc, part_ptr, count_ptr + tile, pid - first, sharers, rm[:, None] * N + cols[None, :],
                             out_mask, M * N)


@triton.jit
def _stream_k_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, xs_ptr, ws_ptr, M, N, K, units, chunks, programs,
                     stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                     IEEE: tl.constexpr, X_SCALED: tl.constexpr = 0, W_SCALED: tl.constexpr = 0,
                     USE_PDL: tl.constexpr = 0):
    pid = tl.program_id(0)
    start = pid * units // programs
    end = (pid + 1) * units // programs
    rm = tl.arange(0, BLOCK_M)
    pdl_wait(USE_PDL)
    for tile in range(start // chunks, (end - 1) // chunks + 1):
        c0 = tl.maximum(start - tile * chunks, 0)
        c1 = tl.minimum(end - tile * chunks, chunks)
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc = k_loop(acc, x_ptr + rm[:, None] * stride_xm, w_ptr + rn[:, None] * stride_wn, rm, M, n_mask,
                     c0 * BLOCK_K, tl.minimum(c1 * BLOCK_K, K), BLOCK_K, NUM_STAGES, IEEE)
        out_mask = (rm[:, None] < M) & n_mask[None, :]
        if (c0 == 0) & (c1 == chunks):  # the whole tile is this program's
            total = acc
            last = c0 == 0  # true here (a scalar of the other branch's type)
        else:
            total, last = _shared_tile_total(acc, part_ptr, count_ptr, tile, pid, units, chunks, programs, rm, rn,
                                             out_mask, M, N)
        if last:
            store_scaled(total, y_ptr, xs_ptr, ws_ptr, rm, rn, n_mask, out_mask, M, stride_ym, X_SCALED,
                         W_SCALED)


@functools.lru_cache(maxsize=256)
def most_sharers(tiles: int, chunks: int, programs: int) -> int:
    """The most programs any tile is shared by (the partial slots a launch needs)."""
    units = tiles * chunks

    def first(unit: int) -> int:
        return ((unit + 1) * programs + units - 1) // units - 1

    return max(first((t + 1) * chunks - 1) - first(t * chunks) + 1 for t in range(tiles))


def stream_k_launch(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor | None,
                    weight_scale: torch.Tensor | None, y: torch.Tensor, block_m: int, config) -> None:
    """y = x_scale * (x @ weight.T) * weight_scale over ``config.waves`` programs a multiprocessor
    (decode_gemm's _launch checks the operands; ``config`` a DecodeGemmConfig)."""
    m, k = x.shape
    n = weight.shape[0]
    tiles, chunks = triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k)
    programs = min(config.waves * sms_of(x.device), tiles * chunks)
    if tiles * chunks * programs >= INDEX_LIMIT:
        raise ValueError("decode_gemm: stream-K's unit arithmetic needs 64 bits here; use wider tiles")
    counters = split_counters(x.device)
    if tiles > counters.numel():
        raise ValueError(f"decode_gemm: {tiles} output tiles exceed the counters; use wider tiles")
    slots = most_sharers(tiles, chunks, programs)
    partials = torch.empty(slots, m, n, dtype=torch.float32, device=x.device) if slots > 1 else y
    _stream_k_kernel[(programs,)](
        x, weight, y, partials, counters, y if x_scale is None else x_scale, y if weight_scale is None else weight_scale,
        m, n, k, tiles * chunks, chunks, programs, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        IEEE=x.dtype == torch.float32, X_SCALED=int(x_scale is not None), W_SCALED=int(weight_scale is not None),
        num_warps=config.num_warps, **pdl_args(x))
