"""Paged decode attention with the batch's key tiles dealt evenly among resident programs.

One program per (sequence, kv head) leaves a decode batch's GPU part idle: B=64 x 8 kv heads
is 512 programs of unequal contexts on 132 multiprocessors holding 3 each, a full wave and a
tail one. Here the batch's work is laid out as one line of tiles (BLOCK_N keys of one kv
head of one sequence; sequences in batch order, then kv heads, then tiles), and a grid of
exactly the programs the GPU holds at once takes equal stretches of it (as stream-K does for
GEMMs). A stretch covers whole (sequence, kv head) units, whose output it writes, and at
most two partial ones, at its ends: their running max, sum and unnormalised output go to
the program's two part slots, and a second pass merges each split unit's parts.

The split points depend on the lengths and the program count only, never on the batch's
padding (empty rows hold no tiles), so a padded graph step splits as the eager one does.
Off by default (kernels/attention.py, BALANCED); benchmarks/attention_decode.py --balanced times
it against the per-sequence launches in CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.attention_tiles import attend_tiles, query_rows
from adapterserve.kernels.pdl import pdl_wait


@triton.jit
def _span(length, lo, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first key attended, first tile's key, tiles) of sequences of these lengths and first keys
    (scalars or vectors alike)."""
    if HAS_WINDOW:
        lo = tl.maximum(lo, length - window)
    first = (lo // BLOCK_N) * BLOCK_N
    return lo, first, tl.where(length > lo, tl.cdiv(length - first, BLOCK_N), 0)


@triton.jit
def _tile_line(lens_ptr, start_ptr, batch, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
               BATCH_PAD: tl.constexpr):
    """Every sequence's tiles [BATCH_PAD] and where its kv heads' tiles end in the line."""
    seqs = tl.arange(0, BATCH_PAD)
    in_batch = seqs < batch
    length = tl.load(lens_ptr + seqs, mask=in_batch, other=0)
    lo = tl.load(start_ptr + seqs, mask=in_batch, other=0)
    tiles = _span(length, lo, window, HAS_WINDOW, BLOCK_N)[2]
    return tiles, tl.cumsum(tiles, 0)


@triton.jit
def _decode_balanced_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, start_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_sn, stride_tb, stride_ob, stride_oh,
    scale, window, batch,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr, INPUT_DOTS: tl.constexpr, PAGES_AHEAD: tl.constexpr,
    BATCH_PAD: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tiles, ends = _tile_line(lens_ptr, start_ptr, batch, window, HAS_WINDOW, BLOCK_N, BATCH_PAD)
    ends = ends * KV_HEADS  # the line holds every kv head's tiles of a sequence before the next sequence's
    total = tl.sum(tiles, axis=0) * KV_HEADS
    per = tl.maximum(tl.cdiv(total, programs), 1)
    t_start = pid * per
    t_end = tl.minimum(t_start + per, total)
    pdl_wait(USE_PDL)  # the step's metadata read; the query and the cache are the kernels' before
    t = t_start
    while t < t_end:
        done = ends <= t
        b = tl.sum(done.to(tl.int32), axis=0)  # the sequence holding tile t, and where its tiles start
        offset = t - tl.max(tl.where(done, ends, 0), axis=0)
        length = tl.load(lens_ptr + b)
        lo, first, b_tiles = _span(length, tl.load(start_ptr + b), window, HAS_WINDOW, BLOCK_N)
        kv_head = offset // b_tiles
        unit_start = t - offset % b_tiles
        seg_end = tl.minimum(t_end, unit_start + b_tiles)
        n_end = tl.minimum(first + (seg_end - unit_start) * BLOCK_N, length)
        q, heads, dims, mask = query_rows(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM,
                                          DIM_PAD, INPUT_DOTS)
        m_i, l_i, acc = attend_tiles(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr + b * stride_tb, kv_head, lo,
                                     first + (t - unit_start) * BLOCK_N, n_end, scale, stride_kn, stride_kh,
                                     stride_sn, GROUP_PAD, HEAD_DIM, DIM_PAD, PAGE, BLOCK_N, KV_FP8, INPUT_DOTS,
                                     PAGES_AHEAD)
        if (unit_start >= t_start) & (unit_start + b_tiles <= t_end):  # the whole unit: its output
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=mask)
        else:  # part of a unit: slot 0 if it opens the stretch, else 1 (it closes it)
            slot = (pid * 2 + (t != t_start).to(tl.int32)) * GROUP_PAD + tl.arange(0, GROUP_PAD)
            tl.store(part_m_ptr + slot, m_i)
            tl.store(part_l_ptr + slot, l_i)
            tl.store(part_o_ptr + slot[:, None] * DIM_PAD + dims[None, :], acc)
        t = seg_end


@triton.jit
def _merge_balanced_kernel(
    lens_ptr, start_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, stride_ob, stride_oh, window, batch, programs,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, BATCH_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """The output of (sequence b, kv head) where its tiles were split among programs (the
    parts of programs p_first..p_last), zeros where it has no key; whole units are left."""
    b, kv_head = tl.program_id(0), tl.program_id(1)
    tiles, ends = _tile_line(lens_ptr, start_ptr, batch, window, HAS_WINDOW, BLOCK_N, BATCH_PAD)
    per = tl.maximum(tl.cdiv(tl.sum(tiles, axis=0) * KV_HEADS, programs), 1)
    b_tiles = _span(tl.load(lens_ptr + b), tl.load(start_ptr + b), window, HAS_WINDOW, BLOCK_N)[2]
    unit_start = tl.sum(tl.where(tl.arange(0, BATCH_PAD) < b, tiles, 0), axis=0) * KV_HEADS + kv_head * b_tiles
    p_first, p_last = unit_start // per, (unit_start + b_tiles - 1) // per
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (tl.arange(0, GROUP_PAD) < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    pdl_wait(USE_PDL)  # the parts are the balanced kernel's
    if b_tiles == 0:
        tl.store(out_ptrs, tl.zeros([GROUP_PAD, DIM_PAD], tl.float32).to(out_ptr.dtype.element_ty), mask=mask)
    elif p_last > p_first:
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for p in range(p_first, p_last + 1):
            slot = (p * 2 + (p * per < unit_start).to(tl.int32)) * GROUP_PAD + tl.arange(0, GROUP_PAD)
            m_p = tl.load(part_m_ptr + slot)
            m_new = tl.maximum(m_i, m_p)
            alpha = tl.exp(m_i - tl.where(m_new > float("-inf"), m_new, 0.0))
            beta = tl.exp(m_p - tl.where(m_new > float("-inf"), m_new, 0.0))
            l_i = l_i * alpha + tl.load(part_l_ptr + slot) * beta
            acc = acc * alpha[:, None] + tl.load(part_o_ptr + slot[:, None] * DIM_PAD + dims[None, :]) * beta[:, None]
            m_i = m_new
        tl.store(out_ptrs, (acc / tl.maximum(l_i, 1e-30)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


MIN_BATCH_PAD = 64  # the lengths vector's least width: one compiled variant for every batch up to it
BLOCK_RESERVE = 1024  # shared memory bytes the driver keeps per resident program (sm_80 on)
_RESIDENT: dict[tuple, int] = {}  # (device, the kernel's compile keys) -> programs per multiprocessor


def resident_programs(device: torch.device, launch: dict, warmup) -> int:
    """Programs of the balanced kernel the GPU holds at once: multiprocessors x how many its
    registers and shared memory fit (the kernel compiled, not run, by ``warmup``; Triton's
    fused-softmax tutorial's reckoning). The interpreter: 4 programs."""
    if device.type != "cuda":
        return 4
    key = (device.index, *sorted((k, v) for k, v in launch.items() if isinstance(v, (int, bool, str))))
    if key not in _RESIDENT:
        compiled = warmup()
        compiled._init_handles()
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        threads = 32 * launch["num_warps"]
        by_regs = props["max_num_regs"] // (triton.cdiv(max(compiled.n_regs, 1), 8) * 8 * threads)
        by_shared = (props["max_shared_mem"] + BLOCK_RESERVE) // (compiled.metadata.shared + BLOCK_RESERVE)
        _RESIDENT[key] = max(1, min(by_regs, by_shared, 2048 // threads))
    return _RESIDENT[key] * torch.cuda.get_device_properties(device).multi_processor_count


def balanced_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, kv_start: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    stride_sn: int, window: int | None, out: torch.Tensor, launch: dict, pdl: dict, programs: int | None = None,
) -> None:
    """paged_decode_attention's semantics with the tiles dealt evenly (module docstring).
    launch: the tile kernel's constexprs and launch options (GROUP, PAGE, BLOCK_N, KV_FP8,
    num_warps, ...: kernels/attention.py builds them); pdl: the launches' PDL keywords;
    programs: the grid (default: as many as the GPU holds at once)."""
    batch, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    launch = {**launch, "KV_HEADS": num_kv, "BATCH_PAD": max(MIN_BATCH_PAD, triton.next_power_of_2(batch))}
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_sn, block_tables.stride(0),
               out.stride(0), out.stride(1))

    def args(parts: tuple) -> tuple:
        return (q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, kv_start, out, *parts, *strides,
                head_dim ** -0.5, window or 0, batch)

    if programs is None:
        dummy = torch.empty(1, launch["DIM_PAD"], dtype=torch.float32, device=q.device)
        programs = resident_programs(q.device, launch, lambda: _decode_balanced_kernel.warmup(
            *args((dummy, dummy, dummy)), grid=(1,), **launch, **pdl))
    slots = programs * 2 * launch["GROUP_PAD"]
    part_m = torch.empty(slots, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_o = torch.empty(slots, launch["DIM_PAD"], dtype=torch.float32, device=q.device)
    _decode_balanced_kernel[(programs,)](*args((part_m, part_l, part_o)), **launch, **pdl)
    merge = {k: launch[k] for k in ("KV_HEADS", "GROUP", "GROUP_PAD", "HEAD_DIM", "DIM_PAD", "BLOCK_N", "HAS_WINDOW",
                                    "BATCH_PAD")}
    _merge_balanced_kernel[(batch, num_kv)](
        context_lens, kv_start, out, part_m, part_l, part_o, out.stride(0), out.stride(1), window or 0, batch,
        programs, **merge, **pdl)
