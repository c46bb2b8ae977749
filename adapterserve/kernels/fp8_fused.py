"""The decoder's elementwise ops that feed an FP8 GEMM, with the per-token e4m3
quantization fused in (Triton): RMSNorm (optionally closing a residual add) before
q|k|v and gate|up, SiLU-mul before down. Each writes its usual output in the
activations' dtype (LoRA and the other adapters read it) and that output quantized
exactly as ``kernels.fp8.quantize_rows`` would (same float32 arithmetic, IEEE
divisions, round to nearest even): ``q`` float8_e4m3fn and a float32 scale per row.
The twins are the unfused ops followed by ``quantize_rows_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.fp8 import (
    FP8,
    FP8_MAX,
    MIN_SCALE,
    quantize_rows_reference,
    quantize_stored_row,
    row_launch,
    row_scale,
    row_warps,
    store_quantized_row,
)
from adapterserve.kernels.fp8_parts import silu_mul_quant_parts, silu_mul_values
from adapterserve.kernels.fused import add_rms_norm, rms_norm, silu_mul
from adapterserve.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_r, stride_o, stride_q,
                           n, eps, fp8_max, min_scale, ADD: tl.constexpr, BLOCK: tl.constexpr,
                           USE_PDL: tl.constexpr = 0):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # the norm's weight: before the PDL wait
    pdl_wait(USE_PDL)
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # residual += x, rounded to the residual's dtype, then the norm of the sum
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (h + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, summed, mask=mask)
        h = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    y = (h * inv).to(out_ptr.dtype.element_ty) * w
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    store_quantized_row(y.to(out_ptr.dtype.element_ty), q_ptr, s_ptr, row, stride_q, cols, mask, fp8_max, min_scale)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   q_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, D] -> (rms_norm(x) [T, D], q [T, D], scale [T, 1]). With ``residual``:
    residual += x first and the norm is of the sum (add_rms_norm). q_dtype other than
    FP8 only for tests under the interpreter."""
    if not x.is_cuda and q_dtype == FP8:
        normed = rms_norm(x, weight, eps) if residual is None else add_rms_norm(x, residual, weight, eps)
        return (normed, *quantize_rows_reference(normed))
    rows, n = x.shape
    out = torch.empty_like(x)
    q = torch.empty(rows, n, dtype=q_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    res = x if residual is None else residual
    block = triton.next_power_of_2(n)  # one pass: the norm needs the whole row
    _rms_norm_quant_kernel[(rows,)](x, res, weight, out, q, scale, x.stride(0), res.stride(0), out.stride(0),
                                    q.stride(0), n, eps, FP8_MAX, MIN_SCALE, ADD=residual is not None,
                                    BLOCK=block, num_warps=row_warps(block), **pdl_args(x))
    return out, q, scale


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, out_ptr, q_ptr, s_ptr, stride_g, stride_o, stride_q, n, fp8_max, min_scale,
                           BLOCK: tl.constexpr, ONE_PASS: tl.constexpr = 0, USE_PDL: tl.constexpr = 0):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    pdl_wait(USE_PDL)
    if ONE_PASS:  # the whole row in registers: gate|up read once, the output quantized from them
        mask = cols < n
        y = silu_mul_values(gu_ptr + row * stride_g, n, cols, mask, out_dtype)
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
        store_quantized_row(y, q_ptr, s_ptr, row, stride_q, cols, mask, fp8_max, min_scale)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):  # silu(gate) * up in the output dtype, and its absmax
            mask = start + cols < n
            y = silu_mul_values(gu_ptr + row * stride_g, n, start + cols, mask, out_dtype)
            tl.store(out_ptr + row * stride_o + start + cols, y, mask=mask)
            amax = tl.maximum(amax, tl.where(mask, tl.abs(y.to(tl.float32)), 0.0))
        scale = row_scale(tl.max(amax, axis=0), fp8_max, min_scale)
        tl.store(s_ptr + row, scale)  # each thread reads back what it wrote
        quantize_stored_row(out_ptr + row * stride_o, q_ptr + row * stride_q, scale, n, fp8_max, BLOCK)


# values of a row per program of the two-launch SiLU-mul quantization (kernels/fp8_parts.py); 0: one
# program per row. Parts of 2,048 were faster than one pass at 1 to 2,048 tokens on the H200 (the 8B's
# 64 tokens: 6.5 against 8.0 us; benchmarks/fp8_row_ops.py, BENCHMARKS.md), every bit the same
SILU_PART = 2048


def silu_mul_quant(gate_up: torch.Tensor, q_dtype: torch.dtype = FP8, block: int | None = None,
                   part: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2I] -> (silu(gate) * up [T, I], q [T, I], scale [T, 1]) (``block``: see
    ``kernels.fp8.row_launch``; ``part``: values of a row per program in two launches,
    kernels/fp8_parts.py, default SILU_PART; 0: a program per row)."""
    if not gate_up.is_cuda and q_dtype == FP8:
        y = silu_mul(gate_up)
        return (y, *quantize_rows_reference(y))
    part = SILU_PART if part is None else part
    if part and block is None:
        return silu_mul_quant_parts(gate_up, part, q_dtype)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    q = torch.empty(rows, inter, dtype=q_dtype, device=gate_up.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    _silu_mul_quant_kernel[(rows,)](gate_up, out, q, scale, gate_up.stride(0), out.stride(0), q.stride(0), inter,
                                    FP8_MAX, MIN_SCALE, **row_launch(inter, block), **pdl_args(gate_up))
    return out, q, scale
