"""Paged prefill attention in Triton: the new tokens of every sequence in a step,
packed back to back, attend causally to their sequence's paged KV cache.

Tiling. A program serves one query tile of one sequence for one kv head. Its M
rows are (token, head) pairs: the tile's tokens times the GQA group's query heads
(padded to a power of two), token-major, so every key tile loaded serves the whole
group, and a single decode token still fills group-size rows. Host-built tile
lists (kernels.prefill_tiles) never straddle sequences; a multi-token tile taller
than BLOCK_M rows is split over SUBS programs. A tile of sequence -1 is padding
(fixed-length lists of a captured step) and its programs return at once. Decode rows of a mixed step run in
a second launch with BLOCK_M = max(16, group), so they do not pay for
prefill-sized tiles. Grid: (tiles x SUBS, kv heads).

Key tiles. Those past the program's last query (causal) and those before
kv_start or the first query's sliding window are never read. The rest run in
three stretches: masked head, unmasked middle (every row sees every key), masked
tail (the causal diagonal); masks apply causality, kv_start and the window per
(row, key). Online softmax in float32; both products on tensor cores in the
cache's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.fp8 import FP8
from adapterserve.kernels.kv_fp8 import kv_scales
from adapterserve.kernels.prefill_tiles import PrefillTiles

LOG2E = 1.4426950408889634


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_kv, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, kv_head, dims, dim_ok, start, end, lo, hi,
    stride_kn, stride_kh, stride_sn, qk_scale, window,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Online softmax over key tiles [start, end); MASKED applies [lo, hi), causality
    and the window per (row, key); unmasked tiles are visible to every row. KV_FP8: e4m3
    entries widened (exactly) to q's dtype, their scales applied to each key's scores and
    each value's weights."""
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            key_ok = (offs >= lo) & (offs < hi)
        else:
            key_ok = offs >= 0
        page = tl.load(table_ptr + offs // PAGE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * PAGE + offs % PAGE
        kv_off = slot[:, None] * stride_kn + kv_head * stride_kh + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if KV_FP8:
            s = s * tl.load(ks_ptr + slot * stride_sn + kv_head, mask=key_ok, other=0.0)[None, :]
        if MASKED:
            visible = key_ok[None, :] & (offs[None, :] <= q_kv[:, None])
            if HAS_WINDOW:
                visible = visible & (offs[None, :] > q_kv[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
            p = p * tl.load(vs_ptr + slot * stride_sn + kv_head, mask=key_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, start_ptr, cu_ptr, tiles_ptr, out_ptr,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_sn, stride_tb, stride_ot, stride_oh,
    qk_scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_TOKENS: tl.constexpr,
    SUBS: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    tile = tl.program_id(0) // SUBS
    sub = tl.program_id(0) % SUBS
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    if seq < 0:  # padding tile
        return
    row0 = tl.load(cu_ptr + seq)
    count = tl.load(cu_ptr + seq + 1) - row0
    first_kv = tl.load(lens_ptr + seq) - count  # kv index of the sequence's first new token
    tile_q0 = tl.load(tiles_ptr + 2 * tile + 1)
    q_lo = tile_q0 + sub * (BLOCK_M // GROUP_PAD)
    q_hi = tl.minimum(tl.minimum(q_lo + BLOCK_M // GROUP_PAD, tile_q0 + TILE_TOKENS), count)

    # rows: (token, head of the group), token-major
    rows = tl.arange(0, BLOCK_M)
    token = q_lo + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_hi) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = (row0 + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_kv = first_kv + token  # kv index of each row's query

    # keys some row sees: [lo, hi); keys every row sees: [full_lo, full_hi)
    kv_start = tl.load(start_ptr + seq)
    lo = kv_start
    full_lo = kv_start
    if HAS_WINDOW:
        lo = tl.maximum(lo, first_kv + q_lo - window + 1)
        full_lo = tl.maximum(full_lo, first_kv + q_hi - window)
    hi = tl.where(q_lo < q_hi, first_kv + q_hi, 0)  # 0: a sub-tile past the sequence's last query
    start = (lo // BLOCK_N) * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(start, tl.cdiv(full_lo, BLOCK_N) * BLOCK_N), hi)
    mid_hi = tl.minimum(tl.maximum(mid_lo, (first_kv + q_lo + 1) // BLOCK_N * BLOCK_N), hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = table_ptr + seq * stride_tb
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_kv, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kv_head, dims, dim_ok,
                            start, mid_lo, lo, hi, stride_kn, stride_kh, stride_sn,
                            qk_scale, window, PAGE, BLOCK_N, True, HAS_WINDOW, PRECISION, KV_FP8)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_kv, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kv_head, dims, dim_ok,
                            mid_lo, mid_hi, lo, hi, stride_kn, stride_kh, stride_sn,
                            qk_scale, window, PAGE, BLOCK_N, False, HAS_WINDOW, PRECISION, KV_FP8)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_kv, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kv_head, dims, dim_ok,
                            mid_hi, hi, lo, hi, stride_kn, stride_kh, stride_sn,
                            qk_scale, window, PAGE, BLOCK_N, True, HAS_WINDOW, PRECISION, KV_FP8)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_off = (row0 + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_start: torch.Tensor,
    cu_q: torch.Tensor,
    tiles: PrefillTiles,
    page_size: int,
    window: int | None,
    out: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Causal attention of every new token over its sequence's paged context.

    q:            [T, Hq, D], sequence b's new tokens in rows cu_q[b] .. cu_q[b+1]
                  (their k/v are already in the cache)
    k_cache, v_cache: [slots, Hkv, D]; slot of kv index j = table[b, j // page] * page + j % page
    block_tables: [B, max_pages] int32;  context_lens: [B] int32 kv entries after the step
    kv_start:     [B] int32 first valid kv index (entries before it are skipped)
    cu_q:         [B + 1] int32 query row offsets
    tiles:        query tiles from build_prefill_tiles over the same counts (or padded to a
                  fixed length with sequence -1 entries: prefill_tiles.padded_tile_lists)
    out:          [T, Hq, D]
    Semantics: query i of sequence b (n new tokens, context L) sits at kv index
    t = L - n + i; out = softmax(q . K[j] / sqrt(D)) V over j in
    [max(kv_start, t - window + 1), t], K, V of kv head h // (Hq / Hkv).
    block_m: rows (token x group head) per multi-token program; block_n: keys per tile.
    k_scale, v_scale: [slots, Hkv] float32, an FP8 (e4m3) cache's scales (kernels/kv_fp8.py).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_kv = k_cache.shape[1]
    group = q.shape[1] // num_kv
    group_pad = triton.next_power_of_2(group)
    on_gpu = q.is_cuda
    k_scale, v_scale, stride_sn = kv_scales(k_cache, k_scale, v_scale)
    args = (q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, kv_start, cu_q)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_sn, block_tables.stride(0),
               out.stride(0), out.stride(1))
    consts = {
        "GROUP": group, "GROUP_PAD": group_pad, "HEAD_DIM": q.shape[2],
        "DIM_PAD": max(16, triton.next_power_of_2(q.shape[2])), "PAGE": page_size,
        "BLOCK_N": block_n or (64 if on_gpu else 16), "HAS_WINDOW": window is not None,
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32", "num_stages": num_stages,
        "KV_FP8": k_cache.dtype == FP8,
    }
    scale = q.shape[2] ** -0.5 * LOG2E
    launches = ((tiles.single, 1, 16), (tiles.multi, tiles.tile_tokens, block_m or (256 if on_gpu else 16)))
    for tile_list, tile_tokens, rows in launches:
        if tile_list.shape[0] == 0:
            continue
        rows = max(16, group_pad, min(rows, tile_tokens * group_pad))
        subs = -(-tile_tokens // (rows // group_pad))
        _prefill_kernel[(tile_list.shape[0] * subs, num_kv)](
            *args, tile_list, out, *strides, scale, window or 0,
            BLOCK_M=rows, TILE_TOKENS=tile_tokens, SUBS=subs, num_warps=num_warps or (8 if rows >= 256 else 4),
            **consts,
        )
