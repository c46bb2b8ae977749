"""The per-step adapter metadata of a decode-sized batch in one launch (kernels/metadata.py's
grouping and tile list, which take some thirty small torch launches a step).

One program: it counts the tokens of each slot, stores the counts and their exclusive prefix sums
(no-adapter tokens first), places each token in the stable order by slot, then builds the tile
list from the counts. Its gathers read back what it stored (a barrier between): a register vector
cannot be indexed by a vector. Every loop runs over chunks of tokens, slots or tiles, so registers
do not grow with T or S, and one compiled form serves every batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 512  # larger batches (prefill) take the torch ops: the rank pass grows as T x T
CHUNK = 64  # tokens, slots or tiles per step of a loop


@triton.jit
def _keys(slots_ptr, t, T):
    """Each token's slot + 1 (0: no adapter); -1 past the batch."""
    return tl.where(t < T, tl.maximum(tl.load(slots_ptr + t, mask=t < T, other=0) + 1, 0), -1)


@triton.jit
def _count_pass(slots_ptr, counts_ptr, starts_ptr, last_ptr, T, S, block_m, CHUNK: tl.constexpr):
    """Each slot's token count and first position (no-adapter tokens first), and the running sum of
    its tiles (last_ptr: inclusive)."""
    carry = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), axis=0)
    for t0 in range(0, T, CHUNK):
        carry += tl.sum((_keys(slots_ptr, t0 + tl.arange(0, CHUNK), T) == 0).to(tl.int32), axis=0)
    tiles = carry * 0
    for s0 in range(0, S, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        counts = tl.zeros([CHUNK], dtype=tl.int32)
        for t0 in range(0, T, CHUNK):
            key = _keys(slots_ptr, t0 + tl.arange(0, CHUNK), T)
            counts += tl.sum((key[None, :] == s[:, None] + 1).to(tl.int32), axis=1)
        ends = carry + tl.cumsum(counts, axis=0)
        per_slot = (counts + block_m - 1) // block_m
        last = tiles + tl.cumsum(per_slot, axis=0)
        tl.store(counts_ptr + s, counts, mask=s < S)
        tl.store(starts_ptr + s, ends - counts, mask=s < S)
        tl.store(last_ptr + s, last, mask=s < S)
        carry += tl.sum(counts, axis=0)
        tiles += tl.sum(per_slot, axis=0)


@triton.jit
def _place_pass(slots_ptr, starts_ptr, sorted_ptr, T, S, CHUNK: tl.constexpr):
    """sorted_tokens: each token at its slot's start plus the number of earlier tokens of its slot."""
    for t0 in range(0, T, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        key = _keys(slots_ptr, t, T)
        rank = tl.zeros([CHUNK], dtype=tl.int32)
        for u0 in range(0, t0 + CHUNK, CHUNK):  # the chunks up to this one hold every earlier token
            u = u0 + tl.arange(0, CHUNK)
            earlier = (_keys(slots_ptr, u, T)[None, :] == key[:, None]) & (u[None, :] < t[:, None])
            rank += tl.sum(earlier.to(tl.int32), axis=1)
        start = tl.load(starts_ptr + key - 1, mask=(key > 0) & (key <= S), other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + start + rank, t, mask=t < T)


@triton.jit
def _tile_pass(counts_ptr, starts_ptr, last_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, S, n_tiles,
               block_m, CHUNK: tl.constexpr):
    """The tile list: tile i belongs to the first slot whose running tile sum passes i."""
    for i0 in range(0, n_tiles, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        slot = tl.zeros([CHUNK], dtype=tl.int32)
        for s0 in range(0, S, CHUNK):
            s = s0 + tl.arange(0, CHUNK)
            last = tl.load(last_ptr + s, mask=s < S, other=2147483647, cache_modifier=".cg")
            slot += tl.sum((last[None, :] <= i[:, None]).to(tl.int32), axis=1)
        valid = slot < S
        safe = tl.minimum(slot, S - 1)
        counts = tl.load(counts_ptr + safe, cache_modifier=".cg")
        first = tl.load(starts_ptr + safe, cache_modifier=".cg")
        first_tile = tl.load(last_ptr + safe, cache_modifier=".cg") - (counts + block_m - 1) // block_m
        starts = first + (i - first_tile) * block_m
        ends = tl.minimum(starts + block_m, first + counts)
        in_list = i < n_tiles
        tl.store(tile_slots_ptr + i, tl.where(valid, slot, -1), mask=in_list)  # -1: metadata.NO_ADAPTER
        tl.store(tile_starts_ptr + i, tl.where(valid, starts, 0), mask=in_list)
        tl.store(tile_ends_ptr + i, tl.where(valid, ends, 0), mask=in_list)


# one compiled form for every batch: its sizes are runtime values (no recompiling for a new one)
@triton.jit(do_not_specialize=["T", "S", "block_m", "n_tiles"])
def _adapter_meta_kernel(slots_ptr, sorted_ptr, counts_ptr, starts_ptr, last_ptr, tile_slots_ptr, tile_starts_ptr,
                         tile_ends_ptr, T, S, block_m, n_tiles, CHUNK: tl.constexpr):
    _count_pass(slots_ptr, counts_ptr, starts_ptr, last_ptr, T, S, block_m, CHUNK)
    tl.debug_barrier()  # the gathers below read what the whole program stored
    _place_pass(slots_ptr, starts_ptr, sorted_ptr, T, S, CHUNK)
    _tile_pass(counts_ptr, starts_ptr, last_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, S, n_tiles,
               block_m, CHUNK)


def _int32(n: int, device: torch.device) -> torch.Tensor:
    """An output or scratch buffer of the launch (tests poison them)."""
    return torch.empty(n, dtype=torch.int32, device=device)


def adapter_meta_one_launch(slots: torch.Tensor, num_slots: int, block_m: int, n_tiles: int
                            ) -> tuple[torch.Tensor, ...]:
    """(sorted_tokens, slot_counts, slot_starts, tile_slots, tile_starts, tile_ends) of ``slots``
    ([T] int32, contiguous, each in [-1, num_slots)), as metadata.build_adapter_meta's torch
    ops give them, with a tile list of n_tiles entries.
    T at most MAX_TOKENS, num_slots at least 1."""
    num_tokens = int(slots.shape[0])
    if not 0 < num_tokens <= MAX_TOKENS or num_slots < 1 or slots.dtype != torch.int32 or slots.stride(0) != 1:
        raise ValueError(f"adapter_meta_one_launch: needs 1..{MAX_TOKENS} contiguous int32 slots and a slot, "
                         f"got {tuple(slots.shape)} {slots.dtype} over {num_slots} slots")
    sorted_tokens, counts, starts, last = (_int32(n, slots.device) for n in (num_tokens, *[num_slots] * 3))
    tiles = _int32(3 * n_tiles, slots.device).view(3, n_tiles)
    _adapter_meta_kernel[(1,)](slots, sorted_tokens, counts, starts, last, tiles[0], tiles[1], tiles[2],
                               num_tokens, num_slots, block_m, n_tiles, CHUNK=CHUNK, num_warps=4)
    return sorted_tokens, counts, starts, tiles[0], tiles[1], tiles[2]

