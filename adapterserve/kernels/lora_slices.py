"""The LoRA weights of one adapter-aware linear layer, for every slot at once.

A layer may fuse several projections (q, k, v or gate, up) into one output; each
is a *slice* with its own column range of the output. Adapters occupy rows of a
pool: an adapter of rank r holds r rows, so a rank-4 adapter never takes the room
of the largest rank. Every tensor here is allocated once; loading an adapter only
copies into rows and rewrites the slot's entries in ``row_start``/``rank``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraSlices:
    """Pooled LoRA weights of one (possibly fused) linear layer.

    a:           [n_slices, R, K]  A rows (rank rows) per slice, K = in_features
    b:           [R, N]            B^T rows, with the LoRA scaling folded in; slice s
                                   uses columns out_offsets[s]:out_offsets[s+1]
    row_start:   [n_slices, S] int32, first pool row of each slot's rank rows
    rank:        [n_slices, S] int32, each slot's rank on each slice (0 = none)
    out_offsets: n_slices + 1 column offsets into the layer output (host ints)
    max_rank:    largest rank any slot may hold (host int)
    """

    a: torch.Tensor
    b: torch.Tensor
    row_start: torch.Tensor
    rank: torch.Tensor
    out_offsets: tuple[int, ...]
    max_rank: int

    @property
    def num_slices(self) -> int:
        return self.a.shape[0]

    @classmethod
    def allocate(
        cls,
        in_features: int,
        slice_widths: tuple[int, ...],
        pool_rows: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "LoraSlices":
        offsets = [0]
        for width in slice_widths:
            offsets.append(offsets[-1] + width)
        n = len(slice_widths)
        return cls(
            a=torch.zeros(n, pool_rows, in_features, dtype=dtype, device=device),
            b=torch.zeros(pool_rows, offsets[-1], dtype=dtype, device=device),
            row_start=torch.zeros(n, num_slots, dtype=torch.int32, device=device),
            rank=torch.zeros(n, num_slots, dtype=torch.int32, device=device),
            out_offsets=tuple(offsets),
            max_rank=max_rank,
        )
