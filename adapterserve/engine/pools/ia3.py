"""(IA)^3 pools: per linear, one output-scale row per slot, and one input-scale row on
linears of one projection (fused ones share their input: no adapter may scale it, so no
step launches a scale there). A step launches the scales of the smallest tier covering the
places its adapters scale (layers/ia3_places.py): PEFT's defaults, or every place.

Rows of slots without (IA)^3 stay at 1; the ia3 op only touches tokens whose
adapter is (IA)^3, so other families never pay for it. On tensor-parallel linears each
rank keeps its part of the scales (input scales of row-parallel layers, output scales of
column-parallel ones; a row-parallel layer's output scales apply after its all-reduce), from
a whole adapter or all of an AdapterShard cut for it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from adapterserve.adapters_store.formats.families import Adapter, Ia3Adapter
from adapterserve.engine.adapter_shard import linear_part
from adapterserve.layers.ia3_places import TIERS, WIDEST, Ia3Places, Place, tier_covering
from adapterserve.layers.linear import AdapterLinear


class Ia3Pool:
    family = "ia3"

    def __init__(self, linears: list[tuple[int, AdapterLinear]], num_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.linears = linears
        self.places = Ia3Places()  # the tier a step launches scales for, read by every linear
        self._slot_places: dict[int, frozenset[Place]] = {}
        for _, linear in linears:
            linear.ia3_places = self.places
            if len(linear.slice_kinds) == 1:
                linear.ia3_in = torch.ones(num_slots, linear.in_features, dtype=dtype, device=device)
            linear.ia3_out = torch.ones(num_slots, linear.weight.shape[0], dtype=dtype, device=device)

    def rules(self) -> dict[str, Any]:
        """Projections fused with others share their input: (IA)^3 may not scale it there."""
        fused = {kind for _, linear in self.linears if len(linear.slice_kinds) > 1 for kind in linear.slice_kinds}
        return {"ia3_fused_kinds": frozenset(fused)}

    def graph_part(self) -> str:
        """The (IA)^3 part of a decode graph's key: the tier in force (its graphs launch its scales)."""
        return self.places.tier

    @contextmanager
    def for_step(self, ia3_slots: np.ndarray, every: bool = False) -> Iterator[None]:
        """Run a step launching only the scales of the smallest tier covering its adapters'
        places (``ia3_slots``: each token's (IA)^3 slot, -1 none); every: the widest tier, whatever
        they scale (mixed-step graphs: one tier each, fewer graphs to capture; prompt tokens
        outweigh the scale launches there)."""
        used = np.unique(ia3_slots[ia3_slots >= 0]).tolist()  # a prompt step's thousands of tokens: few slots
        places = frozenset().union(*(self._slot_places.get(slot, frozenset()) for slot in used))
        with self.places.using(WIDEST if every else tier_covering(places)):
            yield

    def covering(self, tier: str):
        """Run as if a step's adapters needed ``tier`` (warm-up captures each tier's graphs in it)."""
        return self.places.using(tier)

    @staticmethod
    def tiers() -> tuple[str, ...]:
        return tuple(TIERS)

    def place(self, slot: int, adapter: Adapter) -> bool:
        if adapter.ia3 is None:
            self._slot_places.pop(slot, None)
            return True
        ia3 = adapter.ia3
        self._slot_places[slot] = _places(ia3)
        with torch.no_grad():
            for layer, linear in self.linears:
                spans, offset = linear_part(linear, adapter), 0
                for index, (kind, width) in enumerate(zip(linear.slice_kinds, linear.slice_widths)):
                    scale = ia3.scales.get((layer, kind))
                    if scale is not None and kind in ia3.feedforward:
                        if linear.ia3_in is None:  # check_ia3 refuses these on upload and registration
                            raise ValueError(f"(IA)^3 input scales on {kind}, fused in {linear.slice_kinds}")
                        linear.ia3_in[slot] = spans.input_part(scale, 0).to(linear.ia3_in.device,
                                                                             linear.ia3_in.dtype)
                    elif scale is not None:
                        part = spans.output_part(scale, 0, index)
                        linear.ia3_out[slot, offset : offset + width] = part.to(linear.ia3_out.device,
                                                                                linear.ia3_out.dtype)
                    offset += width
        return True

    def clear(self, slot: int) -> None:
        self._slot_places.pop(slot, None)
        for _, linear in self.linears:
            if linear.ia3_in is not None:
                linear.ia3_in[slot] = 1
            linear.ia3_out[slot] = 1


def _places(ia3: Ia3Adapter) -> frozenset[Place]:
    """The places an adapter scales: each target's input (feedforward) or output."""
    return frozenset((kind, "in" if kind in ia3.feedforward else "out") for _, kind in ia3.scales)
