"""An adapter's host copy in the serving dtype: what the host cache and the engine keep.

Readers check values in float32; the copy kept afterwards takes the pools' dtype
(half the bytes of float32 in bfloat16). Classifier heads stay float32 (their pool
adds the bias in float32, and they are small).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.errors import AdapterError


def in_dtype(adapter: Adapter, dtype: torch.dtype, name: str) -> Adapter:
    """`adapter` with its weights in `dtype` (in place); AdapterError if a value overflows it."""
    cast = _Cast(dtype, name)
    if adapter.lora is not None:
        adapter.lora.modules = {key: replace(m, a=cast(m.a, key), b=cast(m.b, key))
                                for key, m in adapter.lora.modules.items()}
    if adapter.ia3 is not None:
        adapter.ia3.scales = {key: cast(s, key) for key, s in adapter.ia3.scales.items()}
    if adapter.prompt is not None:
        adapter.prompt.embeddings = cast(adapter.prompt.embeddings, "prompt embeddings")
    if adapter.prefix is not None:
        adapter.prefix.keys = cast(adapter.prefix.keys, "prefix keys")
        adapter.prefix.values = cast(adapter.prefix.values, "prefix values")
    if adapter.bottleneck is not None:
        adapter.bottleneck.modules = {
            key: replace(m, down=cast(m.down, key), down_bias=cast(m.down_bias, key), up=cast(m.up, key),
                         up_bias=cast(m.up_bias, key))
            for key, m in adapter.bottleneck.modules.items()
        }
    return adapter


class _Cast:
    def __init__(self, dtype: torch.dtype, name: str) -> None:
        self.dtype, self.name = dtype, name

    def __call__(self, tensor: torch.Tensor, where: object) -> torch.Tensor:
        if tensor.dtype == self.dtype or not tensor.is_floating_point():
            return tensor
        out = tensor.to(self.dtype)
        if not torch.isfinite(out).all():
            raise AdapterError(
                f"adapter '{self.name}' has values at {where} too large for {str(self.dtype).removeprefix('torch.')}, "
                "the dtype this server serves in; rescale the adapter or serve in bfloat16/float32"
            )
        return out
