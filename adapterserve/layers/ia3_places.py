"""Which (IA)^3 scales a step launches: every place, or only those of PEFT's default targets.

A place is a module kind and a side: ("k_proj", "out") scales k_proj's output, ("down_proj", "in")
its input. A linear launches a scale on a side where any of its kinds is a place of the step's
tier. Each launch costs about 2 us of a decode step whatever it scales, while most (IA)^3 adapters
(PEFT's defaults for decoders) scale three places a layer; the others' scales are 1 there. A tier
that covers every place the step's adapters scale gives their exact outputs, so a step takes the
smallest one that does (engine/pools/ia3.py); each tier is its own captured decode graph.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

Place = tuple[str, str]  # (module kind, "in" | "out")

# PEFT's default (IA)^3 targets for Llama, Mistral, Qwen and Gemma decoders: keys, values, down's input
PEFT_DEFAULT_PLACES: frozenset[Place] = frozenset({("k_proj", "out"), ("v_proj", "out"), ("down_proj", "in")})
TIERS: dict[str, frozenset[Place] | None] = {"peft": PEFT_DEFAULT_PLACES, "all": None}  # smallest first
WIDEST = "all"


def tier_covering(places: frozenset[Place]) -> str:
    """The smallest tier whose steps launch a scale at each of ``places``."""
    return next(name for name, tier in TIERS.items() if tier is None or places <= tier)


class Ia3Places:
    """The tier in force, shared by every linear of a model ("all" outside a step's scope)."""

    def __init__(self) -> None:
        self.tier = WIDEST

    def scales(self, kinds: tuple[str, ...], side: str) -> bool:
        """Whether a linear of these module kinds launches its ``side`` scale now."""
        places = TIERS[self.tier]
        return places is None or any((kind, side) in places for kind in kinds)

    @contextmanager
    def using(self, tier: str) -> Iterator[None]:
        if tier not in TIERS:
            raise ValueError(f"(IA)^3 tier must be one of {list(TIERS)}, got {tier!r}")
        before, self.tier = self.tier, tier
        try:
            yield
        finally:
            self.tier = before
