"""Attention over the paged KV cache for a batch mixing prefills and decodes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adapterserve.engine.context import get_context


class PagedAttention(torch.nn.Module):
    """Writes this step's k/v into the cache, then attends each query to its
    sequence's cached context. The caches ([slots, Hkv, D]) are bound by the runner.

    Decode-only steps on a GPU read the cache in place (Triton paged decode
    kernel); steps with prefills gather each sequence's context and run batched
    scaled-dot-product attention with a causal mask.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq * D]
        meta = get_context().attention
        self.k_cache.index_copy_(0, meta.write_slots, k)
        self.v_cache.index_copy_(0, meta.write_slots, v)
        if meta.decode and q.is_cuda:
            return self._decode(q, meta)
        return self._batched(q, meta)

    def _decode(self, q: torch.Tensor, meta) -> torch.Tensor:
        from adapterserve.kernels.attention import paged_decode_attention

        out = torch.empty_like(q)
        paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, meta.kv_start,
                               meta.page_size, self.window, out)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _batched(self, q: torch.Tensor, meta) -> torch.Tensor:
        keys = self.k_cache[meta.kv_slots].transpose(1, 2)  # [B, Hkv, Kmax, D]
        values = self.v_cache[meta.kv_slots].transpose(1, 2)
        queries = q[meta.query_pad].transpose(1, 2)  # [B, Hq, Qmax, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.masks[self.window], enable_gqa=True)
        batch, _, qmax, _ = out.shape
        out = out.transpose(1, 2).reshape(batch * qmax, self.num_heads * self.head_dim)
        return out[meta.token_pad]
