"""Paged decode attention in Triton: one query token per sequence, keys and values
read straight from the paged KV cache through each sequence's block table.

One program per (sequence, kv head) serves all query heads of that group
(grouped-query attention), streaming the context in tiles with an online softmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


DEFAULT_BLOCK_N = 64  # keys per tile on a GPU: best at B=64 and 256 (benchmarks/attention_decode.py)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, start_ptr, out_ptr,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_tb, stride_ob, stride_oh,
    scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    length = tl.load(lens_ptr + b)
    lo = tl.load(start_ptr + b)
    if HAS_WINDOW:
        lo = tl.maximum(lo, length - window)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for n0 in range((lo // BLOCK_N) * BLOCK_N, length, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = (offs >= lo) & (offs < length)
        page = tl.load(table_ptr + b * stride_tb + offs // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + offs % PAGE
        kv_off = slot[:, None] * stride_kn + kv_head * stride_kh + dims[None, :]
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_start: torch.Tensor,
    page_size: int,
    window: int | None,
    out: torch.Tensor,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Attention of each sequence's newest token over its cached context.

    q:            [B, Hq, D] (the token's k/v are already in the cache)
    k_cache, v_cache: [slots, Hkv, D]; slot of kv index j = table[b, j // page] * page + j % page
    block_tables: [B, max_pages] int32;  context_lens: [B] int32 (0 = padding row)
    kv_start:     [B] int32, first valid kv index (entries before it are skipped)
    out:          [B, Hq, D]
    Semantics: out[b, h] = softmax(q[b, h] . K[j] / sqrt(D)) V over j in
    [max(kv_start, len - window), len), K, V of kv head h // (Hq / Hkv).
    """
    batch, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    grid = (batch, num_kv)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, kv_start, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        head_dim ** -0.5, window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), PAGE=page_size,
        BLOCK_N=block_n or (DEFAULT_BLOCK_N if q.is_cuda else 16), HAS_WINDOW=window is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
