"""Adapter ops. CUDA tensors run the Triton kernels, CPU tensors the float32 twin.

Layers call these names whatever the device; ``reference`` holds the twins.
"""
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import (
    NO_ADAPTER,
    AdapterBatchMeta,
    build_adapter_meta,
)
from adapterserve.kernels.ops import (
    bottleneck_adapter,
    ia3_scale,
    lora_expand,
    lora_shrink,
    paged_decode_attention,
    paged_prefill_attention,
    stacked_expand,
)
from adapterserve.kernels.prefill_tiles import PrefillTiles, build_prefill_tiles

__all__ = [
    "NO_ADAPTER",
    "AdapterBatchMeta",
    "LoraSlices",
    "PrefillTiles",
    "bottleneck_adapter",
    "build_adapter_meta",
    "build_prefill_tiles",
    "ia3_scale",
    "lora_expand",
    "lora_shrink",
    "paged_decode_attention",
    "paged_prefill_attention",
    "stacked_expand",
]
