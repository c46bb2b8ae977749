"""Per-step adapter metadata: the batch's tokens grouped by adapter slot.

Built once per engine step on the batch's device, read by every adapter-aware
layer in that step. Building it never synchronises with the host, so a decode
step stays capturable in a CUDA graph.

Besides the per-slot segments it holds a *tile list* for the Triton kernels: each
tile is up to ``block_m`` consecutive tokens of one slot. The list has a fixed
length computed from host ints (``max_tiles``), so launch grids never depend on
device values; entries past the last real tile carry slot -1. On a GPU a batch of up to
metadata_triton.MAX_TOKENS tokens can get all of it from one launch (kernels/metadata_triton.py,
ONE_LAUNCH).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adapterserve.kernels.metadata_triton import MAX_TOKENS, adapter_meta_one_launch

NO_ADAPTER = -1
# the one-launch metadata on CUDA (its GPU test passed on an H200; about 30 us less a traced 8B step)
ONE_LAUNCH = True


@dataclass
class AdapterBatchMeta:
    """Tokens of one step grouped by adapter slot.

    token_slots:   [T] int32, each token's slot (-1 = no adapter)
    sorted_tokens: [T] int32, token indices ordered by slot (stable); tokens
                   without adapter come first
    slot_counts:   [S] int32, tokens per slot
    slot_starts:   [S] int32, where slot s's tokens begin in sorted_tokens
    num_tokens, num_slots: host ints (T, S), fixed shapes for launch grids
    block_m:       host int, tokens per tile (0 when no tile list was built)
    tile_slots:    [max_tiles] int32, slot of each tile; -1 past the last tile
    tile_starts:   [max_tiles] int32, first position of the tile in sorted_tokens
    tile_ends:     [max_tiles] int32, one past its last position
    stacked_expand: LoRA's stacked layout: the expand the step runs ("tiled" or
                   "grouped"), a host choice from its distinct adapters (stacked.choose_expand)
    """

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_counts: torch.Tensor
    slot_starts: torch.Tensor
    num_tokens: int
    num_slots: int
    block_m: int = 0
    tile_slots: torch.Tensor | None = None
    tile_starts: torch.Tensor | None = None
    tile_ends: torch.Tensor | None = None
    stacked_expand: str = "tiled"

    @property
    def max_tiles(self) -> int:
        return 0 if self.tile_slots is None else int(self.tile_slots.shape[0])


def default_block_m(num_tokens: int) -> int:
    """Tokens per tile: small tiles for decode-sized batches, larger for prefill."""
    return 16 if num_tokens <= 1024 else 32


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound on tiles: every non-empty slot adds at most one partial tile."""
    return -(-num_tokens // block_m) + min(num_slots, num_tokens)


def build_tiles(
    slot_counts: torch.Tensor, slot_starts: torch.Tensor, num_tokens: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed-length tile list (tile_slots, tile_starts, tile_ends), no host sync.

    slot_counts, slot_starts: [S] int32. Returns three [max_tiles] int32 tensors.
    """
    num_slots = int(slot_counts.shape[0])
    device = slot_counts.device
    n = max_tiles(num_tokens, num_slots, block_m)
    if num_slots == 0 or n == 0:
        empty = torch.full((n,), NO_ADAPTER, dtype=torch.int32, device=device)
        return empty, torch.zeros_like(empty), torch.zeros_like(empty)
    per_slot = (slot_counts + (block_m - 1)) // block_m
    last = torch.cumsum(per_slot, 0, dtype=torch.int32)  # inclusive tile ends per slot
    idx = torch.arange(n, dtype=torch.int32, device=device)
    slot = torch.searchsorted(last, idx, right=True).to(torch.int32)
    valid = slot < num_slots
    safe = slot.clamp(max=num_slots - 1).long()
    first_tile = last[safe] - per_slot[safe]
    seg_end = slot_starts[safe] + slot_counts[safe]
    starts = slot_starts[safe] + (idx - first_tile) * block_m
    ends = torch.minimum(starts + block_m, seg_end)
    tile_slots = torch.where(valid, slot, torch.full_like(slot, NO_ADAPTER))
    zero = torch.zeros_like(starts)
    return tile_slots, torch.where(valid, starts, zero), torch.where(valid, ends, zero)


def group_by_slot(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_tokens, slot_counts, slot_starts) of [T] int32 slots, in torch ops (no host sync)."""
    sorted_tokens = torch.argsort(slots, stable=True).to(torch.int32)
    shifted = (slots.long() + 1).clamp_(min=0)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, shifted, torch.ones_like(slots))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    slot_counts = counts[1:].contiguous()
    return sorted_tokens, slot_counts, (ends[1:] - slot_counts).contiguous()


def build_adapter_meta(
    token_slots: torch.Tensor, num_slots: int, block_m: int | None = None, stacked_expand: str = "tiled"
) -> AdapterBatchMeta:
    """Group tokens by slot without a host sync. token_slots: [T] int, -1 = none.

    block_m: tokens per kernel tile (default: ``default_block_m(T)``); stacked_expand: the
    step's stacked LoRA expand (AdapterBatchMeta.stacked_expand).
    """
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D, got shape {tuple(token_slots.shape)}")
    slots = token_slots.to(torch.int32).contiguous()  # the kernels index tokens with stride 1
    num_tokens = int(slots.shape[0])
    block_m = default_block_m(num_tokens) if block_m is None else block_m
    if block_m < 1:
        raise ValueError(f"block_m must be positive, got {block_m}")
    if ONE_LAUNCH and slots.is_cuda and 0 < num_tokens <= MAX_TOKENS and num_slots > 0:  # one launch, not thirty
        sorted_tokens, slot_counts, slot_starts, tile_slots, tile_starts, tile_ends = adapter_meta_one_launch(
            slots, num_slots, block_m, max_tiles(num_tokens, num_slots, block_m))
    else:
        sorted_tokens, slot_counts, slot_starts = group_by_slot(slots, num_slots)
        tile_slots, tile_starts, tile_ends = build_tiles(slot_counts, slot_starts, num_tokens, block_m)
    return AdapterBatchMeta(
        token_slots=slots,
        sorted_tokens=sorted_tokens,
        slot_counts=slot_counts,
        slot_starts=slot_starts,
        num_tokens=num_tokens,
        num_slots=num_slots,
        block_m=block_m,
        tile_slots=tile_slots,
        tile_starts=tile_starts,
        tile_ends=tile_ends,
        stacked_expand=stacked_expand,
    )
