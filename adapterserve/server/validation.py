"""Checking an upload against the served backbone before the store keeps it."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.read import AdapterLimits, read_adapter
from adapterserve.adapters_store.formats.types import BackboneSpec
from adapterserve.errors import AdapterError


def backbone_spec(static: Mapping[str, Any]) -> BackboneSpec:
    """The spec a replica reported (its `describe()["static"]`)."""
    shapes = {kind: (int(i), int(o)) for kind, (i, o) in static["linear_shapes"].items()}
    return BackboneSpec(static["model_type"], static["num_layers"], static["hidden_size"], shapes,
                        static["num_kv_heads"], static["head_dim"], static["layers_prefix"])


def describe_adapter(adapter: Adapter) -> dict[str, Any]:
    """What the store records about an upload (shown by list/describe)."""
    info: dict[str, Any] = {"kind": adapter.kind}
    if adapter.lora is not None:
        info["rank"] = adapter.lora.rank
        info["target_modules"] = sorted({kind for _, kind in adapter.lora.modules})
    if adapter.bottleneck is not None:
        info["rank"] = adapter.bottleneck.rank
    if adapter.num_virtual or adapter.prefix_len:
        info["virtual_tokens"] = adapter.num_virtual or adapter.prefix_len
    if adapter.head is not None:
        info["labels"] = [adapter.head.id2label[i] for i in range(adapter.head.num_labels)]
    return info


def adapter_validator(statics: Sequence[Mapping[str, Any]], name: str) -> Callable[[Path], dict[str, Any]]:
    """A store validator: reads the staged copy in any supported format against each served
    backbone in turn; records the first that fits as "backbone"; AdapterError if none does."""

    def validate(path: Path) -> dict[str, Any]:
        refusals = []
        for static in statics:
            spec, limits = backbone_spec(static), AdapterLimits(**static["limits"])
            try:
                return {**describe_adapter(read_adapter(path, spec, limits, name=name)),
                        "backbone": static["backbone_id"]}
            except AdapterError as exc:
                refusals.append(exc)
        if len(refusals) == 1:
            raise refusals[0]
        raise AdapterError("; ".join(f"for backbone {s['backbone_id']!r}: {e}" for s, e in zip(statics, refusals)))

    return validate
