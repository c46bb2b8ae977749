"""SiLU-mul with the per-token e4m3 quantization, each row split over ``parts`` programs
(``silu_mul_quant_parts``): kernels/fp8_fused.silu_mul_quant runs one program a row, so a
decode batch of 64 tokens keeps 64 multiprocessors busy and each streams a whole 2 x 14,336
row alone. Here every program computes its part of the row, stores it (activations' dtype)
and folds its absmax into the row's running maximum; the last part to finish (a per-row
counter) takes the row's scale and quantizes the row, reading the parts back. Same float32
arithmetic as silu_mul_quant, so the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.fp8 import FP8, FP8_MAX, LOOP_BLOCK, MIN_SCALE, row_scale, row_warps, store_quantized
from adapterserve.kernels.fp8_fused import _silu_mul_row
from adapterserve.kernels.pdl import pdl_args, pdl_wait
from adapterserve.kernels.split_counters import COUNTERS, split_counters, zeroed_maxima


@triton.jit
def _silu_mul_quant_parts_kernel(gu_ptr, out_ptr, q_ptr, s_ptr, max_ptr, count_ptr, stride_g, stride_o, stride_q, n,
                                 part_width, fp8_max, min_scale, PARTS: tl.constexpr, BLOCK: tl.constexpr,
                                 QUANT_BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    row, part = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = part * part_width + offs
    mask = (offs < part_width) & (cols < n)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    pdl_wait(USE_PDL)
    y = _silu_mul_row(gu_ptr + row * stride_g, n, cols, mask, out_dtype)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    tl.atomic_max(max_ptr + row, tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=0), sem="relaxed")
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == PARTS - 1:  # the row's last part: quantize it
        scale = row_scale(tl.load(max_ptr + row, cache_modifier=".cg"), fp8_max, min_scale)
        tl.store(max_ptr + row, 0.0)  # zero for the next launch
        tl.store(s_ptr + row, scale)
        quant = tl.arange(0, QUANT_BLOCK)
        for start in range(0, n, QUANT_BLOCK):
            qmask = start + quant < n
            h = tl.load(out_ptr + row * stride_o + start + quant, mask=qmask, other=0.0, cache_modifier=".cg")
            store_quantized(h.to(tl.float32), scale, q_ptr + row * stride_q, start + quant, qmask, fp8_max)
        tl.atomic_xchg(count_ptr + row, 0)


def silu_mul_quant_parts(gate_up: torch.Tensor, parts: int, q_dtype: torch.dtype = FP8
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2I] -> (silu(gate) * up [T, I], q [T, I], scale [T, 1]) as silu_mul_quant,
    each row over ``parts`` programs (T up to the counters' size; q_dtype other than FP8 only for
    tests under the interpreter)."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if rows > COUNTERS or parts < 1:
        raise ValueError(f"silu_mul_quant_parts: {rows} rows (at most {COUNTERS}), {parts} parts (at least 1)")
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    q = torch.empty(rows, inter, dtype=q_dtype, device=gate_up.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    part_width = triton.cdiv(inter, parts)
    block = triton.next_power_of_2(part_width)
    _silu_mul_quant_parts_kernel[(rows, parts)](
        gate_up, out, q, scale, zeroed_maxima(gate_up.device), split_counters(gate_up.device), gate_up.stride(0),
        out.stride(0), q.stride(0), inter, part_width, FP8_MAX, MIN_SCALE, PARTS=parts, BLOCK=block,
        QUANT_BLOCK=min(LOOP_BLOCK * 4, triton.next_power_of_2(inter)), num_warps=row_warps(block), **pdl_args(gate_up))
    return out, q, scale
