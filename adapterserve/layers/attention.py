"""Attention over the paged KV cache for a batch mixing prefills and decodes."""
from __future__ import annotations

import torch

from adapterserve.kernels import paged_decode_attention, paged_prefill_attention
from adapterserve.layers.context import get_context
from adapterserve.layers.parallel import SINGLE, TensorParallel


class PagedAttention(torch.nn.Module):
    """Writes this step's k/v into the cache, then attends each query to its
    sequence's cached context. The caches ([slots, Hkv, D]) are bound by the runner.

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

    def shard_kv(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of t [..., num_kv_heads (all), head_dim] (e.g. a prefix's keys)."""
        return t.narrow(-2, self.first_kv_head, self.num_kv_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None
                ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] (None: already written with RoPE) -> [T, Hq * D]
        meta = get_context().attention
        if k is not None:
            self.k_cache.index_copy_(0, meta.write_slots, k)
            self.v_cache.index_copy_(0, meta.write_slots, v)
        out = torch.empty_like(q)
        if meta.decode:
            paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                   meta.kv_start, meta.page_size, self.window, out, meta.decode_order)
        else:
            paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                    meta.kv_start, meta.cu_q, meta.tiles, meta.page_size, self.window, out)
        return out.view(q.shape[0], self.num_heads * self.head_dim)
