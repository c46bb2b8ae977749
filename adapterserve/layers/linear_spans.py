"""Which part of a linear layer's full tensors a tensor-parallel rank holds.

One pure function of the layer's layout (how it is split, its full sizes) and of (rank,
world size): the layer calls it for its own rank, and rank 0 calls it for every other rank
when it cuts an adapter for that rank's pools (engine/adapter_shard.py), so both agree by
construction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adapterserve.layers.parallel import kv_head_span, split_span

Span = tuple[int, int]  # (start, length)


@dataclass(frozen=True)
class LinearSpans:
    """One rank's part of a linear layer: (start, length) of its full input features, and of
    each fused slice's full output features."""

    input: Span
    outputs: tuple[Span, ...]

    def input_part(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This part of t indexed by the input features along dim (a view)."""
        return t.narrow(dim, *self.input)

    def output_part(self, t: torch.Tensor, dim: int, slice_index: int) -> torch.Tensor:
        """This part of t indexed by one slice's output features along dim (a view)."""
        return t.narrow(dim, *self.outputs[slice_index])

    def local(self) -> LinearSpans:
        """The same part, within tensors already cut to it (every span from 0)."""
        return LinearSpans((0, self.input[1]), tuple((0, length) for _, length in self.outputs))


@dataclass(frozen=True)
class LinearLayout:
    """How a (possibly fused) linear layer splits over tensor-parallel ranks, in its full sizes.

    parallel: None (replicated), "column" (each slice's output split) or "row" (input split).
    slice_heads: per slice, None to split its width evenly, or its head count to split it by
    whole heads (kv_head_span: one head replicated over several ranks when there are fewer
    heads than ranks); None for every slice when not given.
    """

    parallel: str | None
    in_features: int
    slice_widths: tuple[int, ...]
    slice_kinds: tuple[str, ...]
    slice_heads: tuple[int | None, ...] | None = None

    def spans(self, rank: int, world_size: int) -> LinearSpans:
        """Rank's part; ValueError naming the size that does not divide by world_size."""
        whole = LinearSpans((0, self.in_features), tuple((0, w) for w in self.slice_widths))
        if world_size == 1 or self.parallel is None:
            return whole
        if self.parallel == "row":
            what = f"the input of {'|'.join(self.slice_kinds)}"
            return LinearSpans(split_span(self.in_features, rank, world_size, what), whole.outputs)
        heads = self.slice_heads or (None,) * len(self.slice_widths)
        outputs = tuple(_column_span(width, count, kind, rank, world_size)
                        for width, count, kind in zip(self.slice_widths, heads, self.slice_kinds))
        return LinearSpans(whole.input, outputs)


def _column_span(width: int, heads: int | None, kind: str, rank: int, world_size: int) -> Span:
    if heads is None:
        return split_span(width, rank, world_size, f"the output of {kind}")
    first, count = kv_head_span(heads, rank, world_size)
    head_width = width // heads
    return first * head_width, count * head_width
