"""What an engine's pools can hold, beyond what the format readers check: one set of
rules that the engine applies on load and the store applies on upload (the engine
reports its rules; an upload is checked against them), so an adapter the engine
would refuse is never stored.

Plain data and checks over a read ``Adapter``; no tensors are touched.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from adapterserve.errors import AdapterError


@dataclass(frozen=True)
class ServingRules:
    """An engine's limits per family; None where the engine has no pool for it (not checked)."""

    virtual_tokens: bool = True  # prompt and prefix tuning (decoder backbones only)
    max_labels: int | None = None  # classifier heads
    max_head_layers: int | None = None
    head_poolings: tuple[str, ...] = ()
    hidden_size: int | None = None
    ia3_fused_kinds: frozenset[str] = frozenset()  # projections that share their input with others
    max_bottleneck_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (for the replica's description and ServerInfo)."""
        d = asdict(self)
        d["head_poolings"], d["ia3_fused_kinds"] = list(self.head_poolings), sorted(self.ia3_fused_kinds)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServingRules:
        return cls(**{**d, "head_poolings": tuple(d["head_poolings"]),
                      "ia3_fused_kinds": frozenset(d["ia3_fused_kinds"])})


def check_servable(adapter: Any, name: str, rules: ServingRules) -> None:
    """AdapterError if an engine with these rules cannot hold `adapter` (a formats.families.Adapter)."""
    check_virtual_tokens(adapter, name, rules.virtual_tokens)
    if rules.max_labels is not None:
        check_head(adapter, name, rules.max_labels, rules.max_head_layers, rules.head_poolings, rules.hidden_size)
    check_ia3(adapter, name, rules.ia3_fused_kinds)
    if rules.max_bottleneck_rank is not None:
        check_bottleneck(adapter, name, rules.max_bottleneck_rank)


def check_virtual_tokens(adapter: Any, name: str, served: bool) -> None:
    if not served and (adapter.prompt is not None or adapter.prefix is not None):
        raise AdapterError(f"adapter '{name}': {adapter.kind} is served on decoder backbones only; "
                           "this backbone is an encoder")


def check_head(adapter: Any, name: str, max_labels: int, max_layers: int | None, poolings: tuple[str, ...],
               hidden: int | None) -> None:
    head = adapter.head
    if head is None:
        return
    if head.num_labels > max_labels:
        raise AdapterError(f"adapter '{name}' has a head with {head.num_labels} labels; this server accepts "
                           f"at most {max_labels} (EngineConfig.max_labels)")
    if max_layers is not None and len(head.layers) > max_layers:
        raise AdapterError(f"adapter '{name}' has a head of {len(head.layers)} layers; this server accepts "
                           f"{max_layers} (EngineConfig.max_head_layers)")
    if head.pooling not in poolings:
        raise AdapterError(f"adapter '{name}' pools with {head.pooling!r}; this backbone pools with "
                           f"{', '.join(poolings)}")
    if len(head.layers) == 2 and head.layers[0].weight.shape[0] != hidden:
        raise AdapterError(f"adapter '{name}': the head's hidden layer must keep the hidden size")


def check_ia3(adapter: Any, name: str, fused_kinds: frozenset[str]) -> None:
    """Fused projections share their input, so only an unfused one may scale it."""
    if adapter.ia3 is None:
        return
    if fused := sorted(fused_kinds & adapter.ia3.feedforward):
        raise AdapterError(
            f"adapter '{name}': (IA)^3 input scaling (feedforward_modules) on {fused} is not "
            "supported: those projections share their input with others; scale an unfused one's input"
        )


def check_bottleneck(adapter: Any, name: str, max_rank: int) -> None:
    if adapter.bottleneck is not None and adapter.bottleneck.rank > max_rank:
        raise AdapterError(
            f"adapter '{name}' has a bottleneck of width {adapter.bottleneck.rank}; this server accepts at "
            f"most {max_rank} (EngineConfig.max_bottleneck_rank)"
        )
