"""Attention over the paged KV cache for a batch mixing prefills and decodes."""
from __future__ import annotations

import torch

from adapterserve.kernels import paged_decode_attention, paged_prefill_attention
from adapterserve.kernels.attention import DEFAULT_DOTS
from adapterserve.kernels.fp8 import FP8
from adapterserve.kernels.kv_fp8 import write_kv
from adapterserve.layers.context import get_context
from adapterserve.layers.parallel import SINGLE, TensorParallel


class PagedAttention(torch.nn.Module):
    """Writes this step's k/v into the cache, then attends each query to its
    sequence's cached context. The caches ([slots, Hkv, D]) are bound by the runner
    (``allocate_cache``); an FP8 cache keeps a float32 scale per (slot, KV head) beside
    each (``k_scale``, ``v_scale``: kernels/kv_fp8.py), None otherwise.

    Both paths read the cache in place: decode-only steps through the paged decode
    op, steps with prefills through the paged prefill op (Triton on a GPU, the
    float32 twins on the CPU).

    Head counts are the model's; over ``tp``'s ranks each holds its contiguous share of
    the query heads and the KV heads they read (TensorParallel.kv_heads: a share, or one
    replicated head when there are fewer KV heads than ranks); num_heads and num_kv_heads
    become this rank's, and its caches hold only its KV heads.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_heads = tp.span(num_heads, "num_attention_heads")[1]
        self.first_kv_head, self.num_kv_heads = tp.kv_heads(num_kv_heads)
        self.head_dim = head_dim
        self.window = window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.decode_dots = DEFAULT_DOTS  # the decode kernel's products (EngineConfig.decode_attention_dots)

    def allocate_cache(self, slots: int, dtype: torch.dtype, device: torch.device, fp8: bool = False) -> None:
        """Zeroed caches of ``slots`` entries in ``dtype``, or in e4m3 with their scales."""
        shape = (slots, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=FP8 if fp8 else dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.k_scale = torch.zeros(shape[:2], dtype=torch.float32, device=device) if fp8 else None
        self.v_scale = None if self.k_scale is None else torch.zeros_like(self.k_scale)

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by cache slot: the caches and, if FP8, their scales."""
        return [t for t in (self.k_cache, self.v_cache, self.k_scale, self.v_scale) if t is not None]

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] (this rank's heads) into the cache slots ``index``."""
        write_kv(self.k_cache, self.k_scale, index, k)
        write_kv(self.v_cache, self.v_scale, index, v)

    def shard_kv(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of t [..., num_kv_heads (all), head_dim] (e.g. a prefix's keys)."""
        return t.narrow(-2, self.first_kv_head, self.num_kv_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None
                ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] (None: already written with RoPE) -> [T, Hq * D]
        meta = get_context().attention
        if k is not None:
            self.write(meta.write_slots, k, v)
        out = torch.empty_like(q)
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if meta.decode:
            paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                   meta.kv_start, meta.page_size, self.window, out, meta.decode_order, **scales,
                                   dots=self.decode_dots)
        else:
            paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                    meta.kv_start, meta.cu_q, meta.tiles, meta.page_size, self.window, out, **scales)
        return out.view(q.shape[0], self.num_heads * self.head_dim)
