"""Triton: the repetition, frequency and presence penalties of a step's penalised rows, in
one pass over each row's logits, output counts and prompt mask."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _penalties_kernel(
    logits_ptr, rows_ptr, table_rows_ptr, counts_ptr, in_prompt_ptr, params_ptr, out_ptr, V,
    stride_l, stride_c, stride_p, stride_o,
    USE_REPETITION: tl.constexpr, USE_FREQUENCY: tl.constexpr, USE_PRESENCE: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    table = tl.load(table_rows_ptr + r).to(tl.int64)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = v < V
    x = tl.load(logits_ptr + row * stride_l + v, mask=mask, other=0.0)
    count = tl.load(counts_ptr + table * stride_c + v, mask=mask, other=0)
    generated = count > 0
    if USE_REPETITION:
        repetition = tl.load(params_ptr + table * 3)
        seen = (tl.load(in_prompt_ptr + table * stride_p + v, mask=mask, other=0) != 0) | generated
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)  # IEEE division
    if USE_FREQUENCY:
        x = x - tl.load(params_ptr + table * 3 + 1) * count.to(tl.float32)
    if USE_PRESENCE:
        x = x - tl.load(params_ptr + table * 3 + 2) * generated.to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * stride_o + v, x, mask=mask)


def penalise_rows(logits: torch.Tensor, rows: torch.Tensor, table_rows: torch.Tensor, counts: torch.Tensor,
                  in_prompt: torch.Tensor, params: torch.Tensor, use: tuple[bool, bool, bool],
                  out: torch.Tensor) -> None:
    """out[i] = logits[rows[i]] with the penalties of table row table_rows[i].

    logits: [G, V] float32; rows, table_rows: [R] long; counts: [N, V] int32 (times each
    token was generated); in_prompt: [N, V] bool; params: [N, 3] float32 (repetition,
    frequency, presence); use: which of the three any row applies; out: [R, V] float32.
    Semantics: seen = in_prompt | count > 0; x = x / rep if x > 0 else x * rep where seen;
    x -= freq * count; x -= pres * (count > 0).
    """
    r, v = out.shape
    if r == 0:
        return
    block = 4096 if logits.is_cuda else 256
    grid = (r, triton.cdiv(v, block))
    in_prompt_bytes = in_prompt.view(torch.uint8)
    _penalties_kernel[grid](
        logits, rows, table_rows, counts, in_prompt_bytes, params, out, v,
        logits.stride(0), counts.stride(0), in_prompt_bytes.stride(0), out.stride(0),
        USE_REPETITION=use[0], USE_FREQUENCY=use[1], USE_PRESENCE=use[2], BLOCK=block,
        num_warps=8 if logits.is_cuda else 4,
    )
