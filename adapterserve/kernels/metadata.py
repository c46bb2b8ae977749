"""Per-step adapter metadata: the batch's tokens grouped by adapter slot.

Built once per engine step on the batch's device, read by every adapter-aware
layer in that step. Building it never synchronises with the host, so a decode
step stays capturable in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NO_ADAPTER = -1


@dataclass
class AdapterBatchMeta:
    """Tokens of one step grouped by adapter slot.

    token_slots:   [T] int32, each token's slot (-1 = no adapter)
    sorted_tokens: [T] int32, token indices ordered by slot (stable); tokens
                   without adapter come first
    slot_counts:   [S] int32, tokens per slot
    slot_starts:   [S] int32, where slot s's tokens begin in sorted_tokens
    num_tokens, num_slots: host ints (T, S), fixed shapes for launch grids
    """

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_counts: torch.Tensor
    slot_starts: torch.Tensor
    num_tokens: int
    num_slots: int


def build_adapter_meta(token_slots: torch.Tensor, num_slots: int) -> AdapterBatchMeta:
    """Group tokens by slot without a host sync. token_slots: [T] int, -1 = none."""
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D, got shape {tuple(token_slots.shape)}")
    slots = token_slots.to(torch.int32)
    sorted_tokens = torch.argsort(slots, stable=True).to(torch.int32)
    shifted = (slots.long() + 1).clamp_(min=0)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, shifted, torch.ones_like(slots))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    slot_counts = counts[1:].contiguous()
    slot_starts = (ends[1:] - slot_counts).contiguous()
    return AdapterBatchMeta(
        token_slots=slots,
        sorted_tokens=sorted_tokens,
        slot_counts=slot_counts,
        slot_starts=slot_starts,
        num_tokens=int(slots.shape[0]),
        num_slots=num_slots,
    )
