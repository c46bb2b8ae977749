"""The LoRA linear of a decode step in one launch (lora_decode="fused").

The linear keeps its weight apart from its A rows (kernels/stacked.py, ``stack_apart``: the
adapters' dtype; an e4m3 weight could not share their buffer anyway) and
kernels/stacked_fused.py reads both: the base product (an FP8 weight's as the linear's own
kernel computes it: W8A8 on the activations' per-token e4m3 rounding for the kernels that
quantize activations, weight-only for the others), the shrink and expand on the unrounded
activations. Elsewhere (CPU, fp8_gemm="reference", a weight too large for the kernel's 32-bit
offsets) the twin: the linear's base product, the shrink by F.linear, the reference expand.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adapterserve.kernels import reference
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.split_counters import INDEX_LIMIT
from adapterserve.kernels.stacked import StackedWeight
from adapterserve.layers.base_gemm import (
    ACTIVATION_QUANTIZING,
    QuantizedRows,
    base_linear,
    quantized_rows,
    resolve_fp8_gemm,
)


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                      stacked: StackedWeight, lora: LoraSlices, meta: AdapterBatchMeta, rows: int,
                      bias: torch.Tensor | None, fp8_gemm: str, quantized: QuantizedRows | None = None
                      ) -> torch.Tensor:
    """x: [T, K] (T <= 64) -> x W^T (+ bias) + each token's LoRA update from a window of ``rows``
    pool rows per slice at the lowest row its tokens use there (reference.window_bases).
    weight: [N, K] in x's dtype, or e4m3 with weight_scale [N]; stacked: its A rows kept apart;
    quantized: x's per-token e4m3 rounding when the op before made it."""
    if x.is_cuda and weight.shape[0] * weight.stride(0) < INDEX_LIMIT:
        from adapterserve.kernels.decode_gemm import decode_config, fp8_fused_config
        from adapterserve.kernels.stacked_fused import BaseApart, stacked_fused

        if weight_scale is None:
            return stacked_fused(x, stacked, lora, meta, rows, bias, decode_config(*weight.shape), BaseApart(weight))
        kernel = resolve_fp8_gemm(fp8_gemm, x.device, x.shape[0])
        if kernel != "reference":
            rounded = quantized_rows(x, quantized) if kernel in ACTIVATION_QUANTIZING else None
            return stacked_fused(x, stacked, lora, meta, rows, bias, fp8_fused_config(*weight.shape),
                                 BaseApart(weight, weight_scale, rounded))
    base = base_linear(x, weight, weight_scale, None, fp8_gemm, quantized)
    bases = reference.window_bases(lora, meta, rows, stacked.pool_rows)
    shrink = F.linear(x, stacked.a_rows()[reference.window_rows(bases, rows).to(x.device)])
    y = torch.empty_like(base)
    reference.stacked_expand(torch.cat([base, shrink], dim=1), lora, meta, y, bias, bases)
    return y
