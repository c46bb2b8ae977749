"""Device dispatch: Triton on CUDA tensors, the float32 reference elsewhere."""
from __future__ import annotations

import torch

from adapterserve.kernels import reference
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.stacked import EXPAND_KERNELS


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def lora_shrink(x: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, out: torch.Tensor) -> None:
    """See reference.lora_shrink."""
    if _on_gpu(x):
        from adapterserve.kernels import lora as triton_lora

        triton_lora.lora_shrink(x, lora, meta, out)
    else:
        reference.lora_shrink(x, lora, meta, out)


def lora_expand(v: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor) -> None:
    """See reference.lora_expand."""
    if _on_gpu(v):
        from adapterserve.kernels import lora as triton_lora

        triton_lora.lora_expand(v, lora, meta, y)
    else:
        reference.lora_expand(v, lora, meta, y)


def stacked_expand(out: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor,
                   bias: torch.Tensor | None = None, expand: str = "tiled") -> None:
    """See reference.stacked_expand (on a GPU the tiled or the grouped kernel, as ``expand``
    says: stacked.choose_expand's choice for the step)."""
    if expand not in EXPAND_KERNELS:
        raise ValueError(f"expand must be one of {EXPAND_KERNELS} (fused: layers/fused_lora.py), got {expand!r}")
    if not _on_gpu(out):
        reference.stacked_expand(out, lora, meta, y, bias)
    elif expand == "grouped":
        from adapterserve.kernels.stacked_grouped import stacked_expand_grouped

        stacked_expand_grouped(out, lora, meta, y, bias)
    else:
        from adapterserve.kernels.stacked_tiled import stacked_expand_tiled

        stacked_expand_tiled(out, lora, meta, y, bias)


def bottleneck_adapter(h, down, down_bias, up, up_bias, rank, activation, meta, workspace, out, residual=None,
                       ln_mix=None) -> None:
    """See reference.bottleneck_adapter."""
    args = (h, down, down_bias, up, up_bias, rank, activation, meta, workspace, out, residual, ln_mix)
    if _on_gpu(h):
        from adapterserve.kernels import bottleneck

        bottleneck.bottleneck_adapter(*args)
    else:
        reference.bottleneck_adapter(*args)


def ia3_scale(x: torch.Tensor, scales: torch.Tensor, meta: AdapterBatchMeta) -> None:
    """See reference.ia3_scale."""
    if _on_gpu(x):
        from adapterserve.kernels import ia3

        ia3.ia3_scale(x, scales, meta)
    else:
        reference.ia3_scale(x, scales, meta)


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, context_lens, kv_start, page_size, window, out, order=None, k_scale=None,
    v_scale=None, dots="auto",
) -> None:
    """See attention.paged_decode_attention (order: a launch order, no effect on the result;
    k_scale, v_scale: an FP8 cache's scales, kernels/kv_fp8.py; dots: the GPU kernel's
    products, the twin's are float32)."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if _on_gpu(q):
        from adapterserve.kernels import attention

        attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, kv_start, page_size,
                                         window, out, order=order, dots=dots, **scales)
    else:
        reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, kv_start, page_size,
                                         window, out, **scales)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, context_lens, kv_start, cu_q, tiles, page_size, window, out, k_scale=None,
    v_scale=None,
) -> None:
    """See prefill_attention.paged_prefill_attention."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if _on_gpu(q):
        from adapterserve.kernels import prefill_attention

        prefill_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, kv_start, cu_q,
                                                  tiles, page_size, window, out, **scales)
    else:
        reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, kv_start, cu_q, tiles,
                                          page_size, window, out, **scales)


def penalise_rows(logits, rows, table_rows, counts, in_prompt, params, use, out) -> None:
    """See reference.penalise_rows (the sampler's repetition, frequency and presence penalties)."""
    if _on_gpu(logits):
        from adapterserve.kernels import penalties

        penalties.penalise_rows(logits, rows, table_rows, counts, in_prompt, params, use, out)
    else:
        reference.penalise_rows(logits, rows, table_rows, counts, in_prompt, params, use, out)

