"""Decode attention's loop with each tile's keys dealt among the program's warps.

The CTA-wide loop (kernels/attention_tiles.py, ``_attend``) spreads a tile's keys over the warps of
one tensor-core layout, so each tile's row max and row sum cross warps through shared memory,
and the softmax weights go through shared memory again to become the second product's operand.
Here warp w takes keys [w * KEYS, (w + 1) * KEYS) of every tile and keeps its own running max,
sum and output (the tiles as [KEY_WARPS, keys, dims] batches of one 3D product each): the
reductions and the weights' change of layout stay within a warp, and the warps' states are
merged once, after the loop. The sums' order differs from the CTA-wide loop's (a warp's keys,
then the warps), not the result's precision.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _warp_keys(n0, lo, n_end, KEY_WARPS: tl.constexpr, KEYS: tl.constexpr):
    """The tile at n0's key offsets [KEY_WARPS, KEYS] (warp w's keys in row w) and which are attended."""
    offs = n0 + tl.arange(0, KEY_WARPS)[:, None] * KEYS + tl.arange(0, KEYS)[None, :]
    return offs, (offs >= lo) & (offs < n_end)


@triton.jit
def _warp_pages(table_row, n0, lo, n_end, PAGE: tl.constexpr, KEY_WARPS: tl.constexpr, KEYS: tl.constexpr):
    """The page numbers of the tile at n0's keys [KEY_WARPS, KEYS] (0 where not attended)."""
    offs, valid = _warp_keys(n0, lo, n_end, KEY_WARPS, KEYS)
    return tl.load(table_row + offs // PAGE, mask=valid, other=0)


@triton.jit
def attend_by_warps(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_row, kv_head, lo, n_start, n_end, scale, stride_kn,
                    stride_kh, stride_sn, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, KEY_WARPS: tl.constexpr):
    """_attend's contract (kernels/attention_tiles.py): (running max, sum of weights, unnormalised
    output) of q [GROUP_PAD, DIM_PAD] over keys [max(lo, n_start), n_end), n_start a multiple of
    BLOCK_N; both products in q's dtype, float32 sums. Each tile's page numbers are read a tile
    ahead, so the loads are pipelined from 3 stages up."""
    KEYS: tl.constexpr = BLOCK_N // KEY_WARPS
    dims = tl.arange(0, DIM_PAD)[None, None, :]
    q3 = tl.broadcast_to(q[None, :, :], (KEY_WARPS, GROUP_PAD, DIM_PAD))
    m_w = tl.full([KEY_WARPS, GROUP_PAD], float("-inf"), tl.float32)
    l_w = tl.zeros([KEY_WARPS, GROUP_PAD], tl.float32)
    acc_w = tl.zeros([KEY_WARPS, GROUP_PAD, DIM_PAD], tl.float32)
    page = _warp_pages(table_row, n_start, lo, n_end, PAGE, KEY_WARPS, KEYS)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs, valid = _warp_keys(n0, lo, n_end, KEY_WARPS, KEYS)
        slot = page.to(tl.int64) * PAGE + offs % PAGE
        page = _warp_pages(table_row, n0 + BLOCK_N, lo, n_end, PAGE, KEY_WARPS, KEYS)
        kv_off = slot[:, :, None] * stride_kn + kv_head * stride_kh + dims
        kv_mask = valid[:, :, None] & (dims < HEAD_DIM)
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q3, tl.permute(k, (0, 2, 1))) * scale
        if KV_FP8:
            s = s * tl.load(ks_ptr + slot * stride_sn + kv_head, mask=valid, other=0.0)[:, None, :]
        s = tl.where(valid[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_w, tl.max(s, axis=2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a warp that has seen no key yet
        alpha = tl.exp(m_w - m_safe)
        p = tl.exp(s - m_safe[:, :, None])
        l_w = l_w * alpha + tl.sum(p, axis=2)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        if KV_FP8:
            p = p * tl.load(vs_ptr + slot * stride_sn + kv_head, mask=valid, other=0.0)[:, None, :]
        acc_w = acc_w * alpha[:, :, None] + tl.dot(p.to(q.dtype), v)
        m_w = m_new
    return _merge_warps(m_w, l_w, acc_w)


@triton.jit
def _merge_warps(m_w, l_w, acc_w):
    """The warps' (max, sum, output) as one: each weighed by exp(its max - the overall max);
    a warp that saw no key weighs 0."""
    m = tl.max(m_w, axis=0)
    weight = tl.exp(m_w - tl.where(m > float("-inf"), m, 0.0)[None, :])
    return m, tl.sum(l_w * weight, axis=0), tl.sum(acc_w * weight[:, :, None], axis=0)
