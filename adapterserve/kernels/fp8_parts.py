"""SiLU-mul with the per-token e4m3 quantization in two launches over parts of each row.

The one-pass kernel (kernels/fp8_fused.py) runs one program per token: at decode's 64 tokens
that is 64 programs, half of an H100's or H200's multiprocessors, each reading a whole row of
gate|up. Here the first launch takes ``part`` values of a row per program, writes silu(gate) * up
in the activations' dtype and that part's absmax; the second, as many programs, takes the row's
absmax from its parts' and quantizes its own part from what the first wrote (still in L2). The
values, the scale and every e4m3 bit are the one-pass kernel's: the same rounding to the output
dtype, the exact max, the same scale and division.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.fp8 import FP8_MAX, MIN_SCALE, row_scale, store_quantized
from adapterserve.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def silu_mul_values(gu_ptr, n, offs, mask, out_dtype: tl.constexpr):
    """silu(gate) * up at ``offs`` of one row of gate|up (gu_ptr: the row), rounded to out_dtype."""
    g = tl.load(gu_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + n + offs, mask=mask, other=0.0).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(out_dtype)


@triton.jit
def _silu_mul_part_kernel(gu_ptr, out_ptr, amax_ptr, stride_g, stride_o, n, PART: tl.constexpr,
                          USE_PDL: tl.constexpr = 0):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * PART + tl.arange(0, PART)
    mask = cols < n
    pdl_wait(USE_PDL)
    y = silu_mul_values(gu_ptr + row * stride_g, n, cols, mask, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    amax = tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=0)
    tl.store(amax_ptr + row * tl.num_programs(1) + part, amax)


@triton.jit
def _quantize_part_kernel(y_ptr, amax_ptr, q_ptr, s_ptr, stride_y, stride_q, n, fp8_max, min_scale,
                          PART: tl.constexpr, PARTS_PAD: tl.constexpr, USE_PDL: tl.constexpr = 0):
    row, part = tl.program_id(0), tl.program_id(1)
    parts = tl.num_programs(1)
    pdl_wait(USE_PDL)
    p = tl.arange(0, PARTS_PAD)
    scale = row_scale(tl.max(tl.load(amax_ptr + row * parts + p, mask=p < parts, other=0.0), axis=0), fp8_max,
                      min_scale)
    if part == 0:
        tl.store(s_ptr + row, scale)
    cols = part * PART + tl.arange(0, PART)
    mask = cols < n
    h = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    store_quantized(h, scale, q_ptr + row * stride_q, cols, mask, fp8_max)


def silu_mul_quant_parts(gate_up: torch.Tensor, part: int, q_dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2I] (Triton's device) -> (silu(gate) * up [T, I], q [T, I], scale [T, 1]),
    ``part`` values of a row per program (a power of two)."""
    if part < 16 or part & (part - 1):
        raise ValueError(f"silu_mul_quant_parts: part must be a power of two of at least 16, got {part}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    q = torch.empty(rows, inter, dtype=q_dtype, device=gate_up.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    parts = triton.cdiv(inter, part)
    amax = torch.empty(rows, parts, dtype=torch.float32, device=gate_up.device)
    warps = max(1, min(8, part // 512))
    _silu_mul_part_kernel[(rows, parts)](gate_up, out, amax, gate_up.stride(0), out.stride(0), inter, PART=part,
                                         num_warps=warps, **pdl_args(gate_up))
    _quantize_part_kernel[(rows, parts)](out, amax, q, scale, out.stride(0), q.stride(0), inter, FP8_MAX, MIN_SCALE,
                                         PART=part, PARTS_PAD=max(2, triton.next_power_of_2(parts)), num_warps=warps,
                                         **pdl_args(gate_up))
    return out, q, scale
