"""FP8 (e4m3) quantization of activations, one row (token) at a time.

``quantize_rows(x)`` gives ``q`` in float8_e4m3fn and a float32 scale per row such
that ``q.float() * scale ~ x``: the dynamic per-token input of an FP8 GEMM.
``quantize_rows_reference`` is the float32 torch twin (CPU and the oracle). Kernel and
twin do the same float32 arithmetic: IEEE-rounded divisions (``div_rn``: Triton's ``/``
is approximate on NVIDIA, which moves values across e4m3 rounding midpoints), the clamp,
then one round-to-nearest-even to e4m3; so they agree bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.pdl import pdl_args, pdl_wait

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its values stay zero)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32); scale = absmax / 448."""
    h = x.float()
    # a tensor divisor: torch on CUDA multiplies by the reciprocal of a Python scalar, which
    # rounds differently from the kernel's (and the CPU's) true division; full_like, not
    # torch.tensor: no host-to-device copy, so it may run inside a CUDA-graph capture
    amax = h.abs().amax(dim=1, keepdim=True)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    return (h / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# the widest row one program holds in registers (one pass: read once, each value kept); at
# 16 warps, 32 values a thread. Wider rows loop over blocks, twice (absmax, then quantize).
ONE_PASS_MAX = 16384
LOOP_BLOCK = 2048


def row_launch(n: int, block: int | None = None) -> dict:
    """A row kernel's BLOCK, ONE_PASS and num_warps for rows of ``n`` values (``block``:
    loop over blocks of that many, for tests and benchmarks)."""
    if block is None:
        block = triton.next_power_of_2(n) if n <= ONE_PASS_MAX else LOOP_BLOCK
    return {"BLOCK": block, "ONE_PASS": block >= n, "num_warps": row_warps(block)}


def row_warps(block: int) -> int:
    """Warps of a program that holds ``block`` values of a row: 4 up to 4,096, at most 16."""
    return max(4, min(16, block // 1024))


@triton.jit
def row_scale(amax, fp8_max, min_scale):
    """A row's scale from its absmax (IEEE division, as the twin)."""
    return tl.maximum(tl.math.div_rn(amax, fp8_max), min_scale)


@triton.jit
def store_quantized(h, scale, q_row_ptr, offs, mask, fp8_max):
    """h (float32) at ``offs`` of one row on its scale, clamped, rounded to q's dtype."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale), -fp8_max), fp8_max)
    tl.store(q_row_ptr + offs, q.to(q_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_stored_row(row_ptr, q_row_ptr, scale, n, fp8_max, BLOCK: tl.constexpr):
    """Quantize one row of n values already in memory (row_ptr) on its scale, BLOCK at a time."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        mask = start + cols < n
        h = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        store_quantized(h, scale, q_row_ptr, start + cols, mask, fp8_max)


@triton.jit
def store_quantized_row(y, q_ptr, s_ptr, row, stride_q, cols, mask, fp8_max, min_scale):
    """Quantize one row held whole in registers (y: its values, masked to ``mask``)."""
    h = y.to(tl.float32)
    scale = row_scale(tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0), fp8_max, min_scale)
    tl.store(s_ptr + row, scale)
    store_quantized(h, scale, q_ptr + row * stride_q, cols, mask, fp8_max)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, n, fp8_max, min_scale, BLOCK: tl.constexpr,
                          ONE_PASS: tl.constexpr = 0, USE_PDL: tl.constexpr = 0):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    pdl_wait(USE_PDL)
    if ONE_PASS:
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        store_quantized_row(x, q_ptr, s_ptr, row, stride_q, cols, mask, fp8_max, min_scale)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0), fp8_max, min_scale)
        tl.store(s_ptr + row, scale)
        quantize_stored_row(x_ptr + row * stride_x, q_ptr + row * stride_q, scale, n, fp8_max, BLOCK)


def quantize_rows_triton(x: torch.Tensor, out_dtype: torch.dtype = FP8, block: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (out_dtype other than FP8 only for tests under the interpreter;
    ``block``: see ``row_launch``)."""
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), n, FP8_MAX, MIN_SCALE,
                                   **row_launch(n, block), **pdl_args(x))
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (last dim contiguous) -> (q, scale [M, 1]); Triton on CUDA, the twin elsewhere."""
    return quantize_rows_triton(x) if x.is_cuda else quantize_rows_reference(x)
