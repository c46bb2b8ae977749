"""Per-token e4m3 quantization with each row split over ``parts`` programs: of SiLU-mul's
output (``silu_mul_quant_parts``) and of a row as it is (``quantize_rows_parts``).
kernels/fp8_fused.silu_mul_quant and kernels/fp8.quantize_rows run one program a row, so a
decode batch of 64 tokens keeps 64 multiprocessors busy and each streams a whole row alone
(2 x 14,336 values for the 8B's SiLU-mul). Here every program takes its part of the row (SiLU-mul:
computes and stores it in the activations' dtype) and folds its absmax into the row's running
maximum; the last part to finish (a per-row counter) takes the row's scale and quantizes the
row, reading the parts back. Same float32 arithmetic as the one-program kernels, so the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.fp8 import FP8, FP8_MAX, LOOP_BLOCK, MIN_SCALE, quantize_stored_row, row_scale, row_warps
from adapterserve.kernels.fp8_fused import _silu_mul_row
from adapterserve.kernels.pdl import pdl_args, pdl_wait
from adapterserve.kernels.split_counters import COUNTERS, split_counters, zeroed_maxima


@triton.jit
def _row_parts_quant_kernel(src_ptr, row_ptr, q_ptr, s_ptr, max_ptr, count_ptr, stride_src, stride_row, stride_q, n,
                            part_width, fp8_max, min_scale, SILU: tl.constexpr, PARTS: tl.constexpr,
                            BLOCK: tl.constexpr, QUANT_BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """SILU: src is gate|up, the row (row_ptr) silu(gate) * up, written here; else src is the row."""
    row, part = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = part * part_width + offs
    mask = (offs < part_width) & (cols < n)
    pdl_wait(USE_PDL)
    if SILU:
        y = _silu_mul_row(src_ptr + row * stride_src, n, cols, mask, row_ptr.dtype.element_ty)
        tl.store(row_ptr + row * stride_row + cols, y, mask=mask)
    else:
        y = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0)
    tl.atomic_max(max_ptr + row, tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=0), sem="relaxed")
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == PARTS - 1:  # the row's last part: quantize it
        scale = row_scale(tl.load(max_ptr + row, cache_modifier=".cg"), fp8_max, min_scale)
        tl.store(max_ptr + row, 0.0)  # zero for the next launch
        tl.store(s_ptr + row, scale)
        quantize_stored_row(row_ptr + row * stride_row, q_ptr + row * stride_q, scale, n, fp8_max, QUANT_BLOCK, ".cg")
        tl.atomic_xchg(count_ptr + row, 0)


def silu_mul_quant_parts(gate_up: torch.Tensor, parts: int, q_dtype: torch.dtype = FP8
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2I] -> (silu(gate) * up [T, I], q [T, I], scale [T, 1]) as silu_mul_quant,
    each row over ``parts`` programs (q_dtype other than FP8 only for tests under the interpreter)."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    q, scale = _launch(gate_up, out, parts, q_dtype, silu=True)
    return out, q, scale


def quantize_rows_parts(x: torch.Tensor, parts: int, q_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] -> (q [T, K], scale [T, 1]) as quantize_rows, each row over ``parts`` programs."""
    return _launch(x, x, parts, q_dtype, silu=False)


def _launch(src: torch.Tensor, row: torch.Tensor, parts: int, q_dtype: torch.dtype, silu: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = row.shape
    if rows > COUNTERS or parts < 1:
        raise ValueError(f"row quantization over parts: {rows} rows (at most {COUNTERS}), {parts} parts (at least 1)")
    q = torch.empty(rows, n, dtype=q_dtype, device=row.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=row.device)
    part_width = triton.cdiv(n, parts)
    block = triton.next_power_of_2(part_width)
    _row_parts_quant_kernel[(rows, parts)](
        src, row, q, scale, zeroed_maxima(row.device), split_counters(row.device), src.stride(0), row.stride(0),
        q.stride(0), n, part_width, FP8_MAX, MIN_SCALE, SILU=silu, PARTS=parts, BLOCK=block,
        QUANT_BLOCK=min(LOOP_BLOCK * 4, triton.next_power_of_2(n)), num_warps=row_warps(block), **pdl_args(row))
    return q, scale
