"""An FP8 KV cache (EngineConfig.kv_cache_dtype="fp8"): keys and values stored in float8
e4m3, one float32 scale per (token, kv head) beside them.

Each head's vector of D values is rounded on its own (scale = its absmax / 448, as
kernels/fp8.quantize_rows does for a row), so no calibration is needed and an outlier
token or head costs only its own precision. The scales add 4 bytes per D bytes (3% at
D=128). Readers widen the entries exactly (to float32, or to the queries' 16-bit dtype)
and fold the scales in: each key's scores times its key scale, each value's softmax
weight times its value scale.

Writers: the fused RoPE + cache write (kernels/fused.rope_and_cache) on a GPU, and
``write_kv`` (torch) for the CPU path and prefix-tuning pages.
"""
from __future__ import annotations

import torch

from adapterserve.kernels.fp8 import FP8, quantize_rows_reference


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] -> (q [T, H, D] float8_e4m3fn, scale [T, H] float32), per (token, head)."""
    tokens, heads, dim = x.shape
    q, scale = quantize_rows_reference(x.reshape(tokens * heads, dim))
    return q.view(tokens, heads, dim), scale.view(tokens, heads)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache entries [N, H, D] as float32 (scale [N, H], or None for a cache in a float dtype)."""
    return q.float() if scale is None else q.float() * scale[..., None]


def write_kv(cache: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, x: torch.Tensor) -> None:
    """cache[index] = x [T, H, D], quantized per (token, head) into an FP8 cache (scale given)."""
    if scale is None:
        cache.index_copy_(0, index, x.to(cache.dtype))
        return
    q, s = quantize_kv(x)
    copy_rows(cache, index, q)
    scale.index_copy_(0, index, s)


def copy_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """cache.index_copy_(0, index, rows), as bytes for e4m3 (torch's CPU index_copy_ has no float8)."""
    if cache.dtype == FP8:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.index_copy_(0, index, rows)


def kv_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(key scales, value scales, their slot stride) for a launch: an FP8 cache's [slots, Hkv]
    float32 scales, or the cache itself twice (never read) for a cache in a float dtype."""
    if (k_scale is None) != (v_scale is None) or (k_scale is not None) != (cache.dtype == FP8):
        raise ValueError(f"an e4m3 KV cache needs both its key and value scales, others neither (cache {cache.dtype})")
    if k_scale is None:
        return cache, cache, 0
    if k_scale.shape != cache.shape[:2] or v_scale.shape != k_scale.shape or k_scale.stride(1) != 1:
        raise ValueError(f"KV scales must be [slots, kv heads] = {tuple(cache.shape[:2])} with unit head stride, "
                         f"got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    return k_scale, v_scale, k_scale.stride(0)
