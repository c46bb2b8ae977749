"""Paged decode attention in Triton: one query token per sequence, keys and values
read straight from the paged KV cache through each sequence's block table.

A program serves all query heads of one kv head (grouped-query attention) over a
stretch of one sequence's context, streaming it in tiles with an online softmax.
When sequences x kv heads are too few to fill the GPU (few, long sequences), each
sequence's context is split into equal parts (split-KV, as in flash-decoding): every
part writes its running max, sum and unnormalised output, and a second pass merges
them. The number of parts depends on host ints only, so a CUDA graph can hold both.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from adapterserve.config import ATTENTION_DOTS
from adapterserve.kernels.attention_tiles import attend_tiles, query_rows
from adapterserve.kernels.fp8 import FP8
from adapterserve.kernels.kv_fp8 import kv_scales
from adapterserve.kernels.pdl import pdl_args, pdl_wait

# keys per tile on a GPU: whole contexts of up to 1024 programs take 128, more programs and split
# parts 64 (chosen by benchmarks/attention_decode.py --sweep; figures in BENCHMARKS.md)
WIDE_BLOCK_N, DEFAULT_BLOCK_N = 128, 64
WARPS, STAGES = 4, 2  # every decode launch's on a GPU
# "keys,warps,stages" for every decode launch on a GPU: a measurement's override of the tiles above
TILES_ENV = "ADAPTERSERVE_ATTENTION_TILES"
WIDE_BLOCK_PROGRAMS = 1024
SPLIT_BELOW_PROGRAMS = 512  # split contexts while sequences x kv heads are fewer than this
SPLIT_TARGET_PROGRAMS = 1024  # programs the split pass aims for
MIN_SPLIT_KEYS = 256  # no part shorter than this for the longest context a table can hold
MAX_SPLITS = 16  # more parts were slower (BENCHMARKS.md, paged decode attention)
# decode attention in the step's PDL chain (kernels/pdl.py) when the process's PDL mode is on: its programs read
# the step's metadata, then wait, so the projection after it may launch early. ADAPTERSERVE_ATTENTION_PDL=0 keeps
# it out (its bits tests passed on the H200; BENCHMARKS.md, twenty-sixth session)
PDL = True
PDL_ENV = "ADAPTERSERVE_ATTENTION_PDL"
# each tile's page numbers read a tile ahead (attention_tiles.attend_tiles): off only to measure the loop as it was
PAGES_AHEAD = True
# parts per context of every decode launch on a GPU (a power of two up to MAX_SPLITS): a measurement's override
# of decode_splits' choice
SPLITS_ENV = "ADAPTERSERVE_ATTENTION_SPLITS"
DEFAULT_DOTS = "auto"  # the products' inputs (paged_decode_attention's ``dots``: one of ATTENTION_DOTS; input_dots)


@triton.jit
def _first_key(lens_ptr, start_ptr, b, window, HAS_WINDOW: tl.constexpr):
    """(context length, first key attended) of sequence b."""
    length = tl.load(lens_ptr + b)
    lo = tl.load(start_ptr + b)
    if HAS_WINDOW:
        lo = tl.maximum(lo, length - window)
    return length, lo


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, start_ptr, order_ptr, out_ptr,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_sn, stride_tb, stride_ob, stride_oh,
    scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
    INPUT_DOTS: tl.constexpr, HAS_ORDER: tl.constexpr, PAGES_AHEAD: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    # programs start in grid order, kv heads fastest: with the sequences longest first, the
    # last wave holds short contexts instead of a few long ones the rest of the GPU waits for
    kv_head, rank = tl.program_id(0), tl.program_id(1)
    if HAS_ORDER:
        b = tl.load(order_ptr + rank)
    else:
        b = rank
    length, lo = _first_key(lens_ptr, start_ptr, b, window, HAS_WINDOW)
    pdl_wait(USE_PDL)  # the step's metadata read; the query and the cache are the kernels' before
    q, heads, dims, mask = query_rows(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM,
                                      DIM_PAD, INPUT_DOTS)
    m_i, l_i, acc = attend_tiles(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr + b * stride_tb, kv_head, lo,
                                 (lo // BLOCK_N) * BLOCK_N, length, scale, stride_kn, stride_kh, stride_sn, GROUP_PAD,
                                 HEAD_DIM, DIM_PAD, PAGE, BLOCK_N, KV_FP8, INPUT_DOTS, PAGES_AHEAD)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, start_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_sn, stride_tb, stride_pb, stride_ph, stride_ps,
    scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
    INPUT_DOTS: tl.constexpr, SPLITS: tl.constexpr, PAGES_AHEAD: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Part `split` of each context: whole tiles, the parts of one sequence near equal."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length, lo = _first_key(lens_ptr, start_ptr, b, window, HAS_WINDOW)
    first = (lo // BLOCK_N) * BLOCK_N
    tiles_per_part = tl.cdiv(tl.cdiv(tl.maximum(length - first, 0), BLOCK_N), SPLITS)
    n_start = first + split * tiles_per_part * BLOCK_N
    n_end = tl.minimum(n_start + tiles_per_part * BLOCK_N, length)
    pdl_wait(USE_PDL)  # the step's metadata read; the query and the cache are the kernels' before
    q, heads, dims, mask = query_rows(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM,
                                      DIM_PAD, INPUT_DOTS)
    m_i, l_i, acc = attend_tiles(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr + b * stride_tb, kv_head, lo, n_start,
                                 n_end, scale, stride_kn, stride_kh, stride_sn, GROUP_PAD, HEAD_DIM, DIM_PAD, PAGE,
                                 BLOCK_N, KV_FP8, INPUT_DOTS, PAGES_AHEAD)
    part = b * stride_pb + heads * stride_ph + split * stride_ps  # an empty part leaves max -inf, sum 0
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    tl.store(part_m_ptr + part, m_i, mask=head_ok)
    tl.store(part_l_ptr + part, l_i, mask=head_ok)
    tl.store(part_o_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)


@triton.jit
def _decode_merge_kernel(
    part_m_ptr, part_l_ptr, part_o_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """out[b, h]: the parts' outputs weighed by exp(their max - the overall max); 0 for no keys."""
    b, h = tl.program_id(0), tl.program_id(1)
    pdl_wait(USE_PDL)  # the parts are the split kernel's
    s = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    part = b * stride_pb + h * stride_ph + s * stride_ps
    m = tl.load(part_m_ptr + part, mask=s < SPLITS, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s < SPLITS, other=0.0)
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                mask=(s < SPLITS)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(m_max > float("-inf"), m_max, 0.0))  # empty parts weigh exp(-inf) = 0
    total = tl.sum(w * l_s, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_splits(batch: int, kv_heads: int, max_keys: int) -> int:
    """Parts per context (host ints only): ADAPTERSERVE_ATTENTION_SPLITS where set; else 1 while
    sequences x kv heads fill the GPU, else up to SPLIT_TARGET_PROGRAMS programs with no part
    under MIN_SPLIT_KEYS of the longest context the block table holds, rounded down to a power of two."""
    forced = forced_splits()
    if forced is not None:
        return forced
    programs = batch * kv_heads
    if programs == 0 or programs >= SPLIT_BELOW_PROGRAMS:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(max_keys, MIN_SPLIT_KEYS), triton.cdiv(SPLIT_TARGET_PROGRAMS, programs))
    return 1 << (max(splits, 1).bit_length() - 1)  # a power of two: few kernel variants to compile


def decode_blocks(batch: int, kv_heads: int, max_keys: int, on_gpu: bool = True,
                  splits: int | None = None) -> tuple[int, int]:
    """(parts per context, keys per tile) of a decode launch, from host ints only
    (``splits``: a caller's fixed choice). Engine warm-up enumerates variants with it."""
    if splits is None:
        splits = decode_splits(batch, kv_heads, max_keys) if on_gpu else 1
    if not on_gpu:
        return splits, 16
    forced = forced_tiles()
    if forced is not None:
        return splits, forced[0]
    wide = splits <= 1 and batch * kv_heads <= WIDE_BLOCK_PROGRAMS
    return splits, WIDE_BLOCK_N if wide else DEFAULT_BLOCK_N


def decode_pipeline() -> tuple[int, int]:
    """(warps, software pipeline stages) of every decode launch: WARPS, STAGES unless
    ADAPTERSERVE_ATTENTION_TILES says otherwise."""
    forced = forced_tiles()
    return (WARPS, STAGES) if forced is None else forced[1:]


def forced_tiles() -> tuple[int, int, int] | None:
    """ADAPTERSERVE_ATTENTION_TILES as (keys per tile, warps, stages), or None where unset; keys
    and warps not powers of two, or out of range, are refused."""
    value = os.environ.get(TILES_ENV, "").strip()
    if not value:
        return None
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{TILES_ENV} must be keys,warps,stages (e.g. 64,4,3), got {value!r}")
    keys, warps, stages = (int(p) for p in parts)
    powers = all(n & (n - 1) == 0 for n in (keys, warps))
    if not (powers and 16 <= keys <= 256 and 1 <= warps <= 16 and 1 <= stages <= 8):
        raise ValueError(f"{TILES_ENV}: keys (16-256) and warps (1-16) powers of two, stages 1-8; got {value!r}")
    return keys, warps, stages


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
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int | None = None,
    order: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    dots: str = DEFAULT_DOTS,
) -> None:
    """Attention of each sequence's newest token over its cached context.

    q:            [B, Hq, D] (the token's k/v are already in the cache)
    k_cache, v_cache: [slots, Hkv, D]; slot of kv index j = table[b, j // page] * page + j % page
    block_tables: [B, max_pages] int32;  context_lens: [B] int32 (0 = padding row)
    kv_start:     [B] int32, first valid kv index (entries before it are skipped)
    out:          [B, Hq, D]
    block_n, num_warps, num_stages: keys per tile, warps, software pipeline stages (default:
                  decode_blocks, decode_pipeline; the loop overlaps its loads from 3 stages up)
    splits:       parts per context (default: decode_splits of the shapes)
    order:        [B] int32, the sequences longest context first (optional; whole contexts
                  only): programs start in this order, which shortens the tail
    k_scale, v_scale: [slots, Hkv] float32, an FP8 (e4m3) cache's scales (kernels/kv_fp8.py)
    dots:         the products' inputs: "float32" (keys, values and weights widened), "input"
                  (q's dtype: bf16 / fp16 tensor-core products, the softmax weights rounded to it)
                  or "auto" (the default: "input" for every launch, input_dots); float32 sums either way
    Semantics: out[b, h] = softmax(q[b, h] . K[j] / sqrt(D)) V over j in
    [max(kv_start, len - window), len), K, V of kv head h // (Hq / Hkv).
    """
    batch, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    warps, stages = decode_pipeline()
    num_warps, num_stages = num_warps or warps, num_stages or stages
    if splits is None or block_n is None:
        chosen = decode_blocks(batch, num_kv, block_tables.shape[1] * page_size, q.is_cuda, splits)
        splits, block_n = chosen if block_n is None else (chosen[0], block_n)
    common = dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), PAGE=page_size,
        BLOCK_N=block_n, HAS_WINDOW=window is not None, KV_FP8=k_cache.dtype == FP8, INPUT_DOTS=input_dots(dots),
        PAGES_AHEAD=int(PAGES_AHEAD), num_warps=num_warps, num_stages=num_stages,
    )
    k_scale, v_scale, stride_sn = kv_scales(k_cache, k_scale, v_scale)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_sn, block_tables.stride(0))
    if splits <= 1:
        _decode_kernel[(num_kv, batch)](
            q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, kv_start,
            order if order is not None else context_lens, out, *strides, out.stride(0), out.stride(1),
            head_dim ** -0.5, window or 0, **common, HAS_ORDER=order is not None, **_pdl(q),
        )
        return
    part_m = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_o = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_strides = (part_m.stride(0), part_m.stride(1), part_m.stride(2))
    _decode_split_kernel[(batch, num_kv, splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, kv_start, part_m, part_l, part_o,
        *strides, *part_strides, head_dim ** -0.5, window or 0, **common, SPLITS=splits, **_pdl(q),
    )
    _decode_merge_kernel[(batch, num_heads)](
        part_m, part_l, part_o, out, *part_strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=common["DIM_PAD"], SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        **_pdl(q),
    )


def forced_splits() -> int | None:
    """ADAPTERSERVE_ATTENTION_SPLITS as parts per context, or None where unset; anything but a
    power of two from 1 to MAX_SPLITS is refused."""
    value = os.environ.get(SPLITS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 1 <= int(value) <= MAX_SPLITS or int(value) & (int(value) - 1):
        raise ValueError(f"{SPLITS_ENV} must be a power of two from 1 to {MAX_SPLITS}, got {value!r}")
    return int(value)


def attention_in_chain() -> bool:
    """Whether decode attention takes the process's PDL mode: ADAPTERSERVE_ATTENTION_PDL=1 or 0
    if set, else PDL (any other value is refused)."""
    value = os.environ.get(PDL_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {value!r}")
    return PDL if value == "" else value == "1"


def _pdl(q: torch.Tensor) -> dict:
    """The launch's PDL keywords: the process's mode (kernels/pdl.py) where PDL is let in here."""
    return pdl_args(q) if attention_in_chain() else {}


def input_dots(dots: str) -> bool:
    """Whether the kernel takes its products in q's dtype. ``auto`` does, whole contexts and split
    ones alike: a pick by split count would change a graph step's numbers (its block table is padded,
    so it splits where the eager step does not) and so its greedy tokens."""
    if dots not in ATTENTION_DOTS:
        raise ValueError(f"dots must be one of {ATTENTION_DOTS}, got {dots!r}")
    return dots != "float32"
