"""Decode attention's loop over one stretch of a sequence's context: the query rows of a kv
head's group and the online softmax over their keys, tile by tile, read through the block
table (the whole-context and split-context kernels of kernels/attention.py share it)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tiles(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_row, kv_head, lo, n_start, n_end, scale, stride_kn,
                 stride_kh, stride_sn, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, INPUT_DOTS: tl.constexpr,
                 PAGES_AHEAD: tl.constexpr):
    """Online softmax of q [GROUP_PAD, DIM_PAD] over keys [max(lo, n_start), n_end), n_start
    a multiple of BLOCK_N: (running max, sum of weights, unnormalised output), float32.
    KV_FP8: e4m3 entries, their scales [slots, Hkv] (slot stride stride_sn) applied to each
    key's scores and each value's weights. INPUT_DOTS: both products take q's dtype (keys and
    values as stored or widened to it, the weights rounded to it), else float32; float32 sums.
    PAGES_AHEAD: each tile's page numbers are read a tile ahead, so a tile's keys and values are
    addressed by the loop's carried values and Triton's pipeliner keeps num_stages - 1 tiles in
    flight (read in the tile itself, their load takes a stage of the pipeline: one buffer, no
    overlap); the same products either way."""
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    if PAGES_AHEAD:
        page = _tile_pages(table_row, n_start, lo, n_end, PAGE, BLOCK_N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = (offs >= lo) & (offs < n_end)
        if PAGES_AHEAD:
            pages = page
            page = _tile_pages(table_row, n0 + BLOCK_N, lo, n_end, PAGE, BLOCK_N)
        else:
            pages = _tile_pages(table_row, n0, lo, n_end, PAGE, BLOCK_N)
        slot = pages.to(tl.int64) * PAGE + offs % PAGE
        kv_off = slot[:, None] * stride_kn + kv_head * stride_kh + dims[None, :]
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale
        if KV_FP8:
            k_scale = tl.load(ks_ptr + slot * stride_sn + kv_head, mask=valid, other=0.0)
            s = s * k_scale[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        weights = p
        if KV_FP8:
            weights = p * tl.load(vs_ptr + slot * stride_sn + kv_head, mask=valid, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(weights.to(q.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tile_pages(table_row, n0, lo, n_end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page number of each key of the tile starting at n0 (0 where the key is not attended)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    return tl.load(table_row + offs // PAGE, mask=(offs >= lo) & (offs < n_end), other=0)


@triton.jit
def query_rows(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
               HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, INPUT_DOTS: tl.constexpr):
    """The query rows of kv head's group [GROUP_PAD, DIM_PAD] (float32, or in q's dtype with
    INPUT_DOTS), their heads and mask."""
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (tl.arange(0, GROUP_PAD) < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0)
    if not INPUT_DOTS:
        q = q.to(tl.float32)
    return q, heads, dims, mask
