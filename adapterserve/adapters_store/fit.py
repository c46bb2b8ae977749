"""Whether an adapter directory fits a served backbone: the one check an upload gets, on
the server before the store keeps it and in the CLI before it is sent.

A backbone is described by its replica's `describe()["static"]` (ServerInfo carries the
same as JSON): its shapes, the readers' limits and the pools' `ServingRules`. The check
reads the directory as the engine will (every format) and applies the engine's own
pool checks (`servable.check_servable`), so what passes here loads there.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adapterserve.adapters_store.formats.types import AdapterLimits, BackboneSpec
from adapterserve.adapters_store.servable import ServingRules, check_servable
from adapterserve.adapters_store.staging import ADAPTER_FILES
from adapterserve.errors import AdapterError

if TYPE_CHECKING:
    from adapterserve.adapters_store.formats.families import Adapter

# The files each format consists of (besides a README / LICENSE / model card).
PEFT_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors"})
ADAPTERHUB_FILES = ADAPTER_FILES - {"adapter_model.safetensors"}


def backbone_facts(backbone_id: str, spec: BackboneSpec, limits: AdapterLimits, rules: ServingRules) -> dict[str, Any]:
    """The part of a replica's description (`describe()["static"]`) that the upload check reads."""
    return {
        "backbone_id": backbone_id,
        "model_type": spec.model_type,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "linear_shapes": dict(spec.linear_shapes),
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "layers_prefix": spec.layers_prefix,
        "limits": asdict(limits),
        "servable": rules.to_dict(),
    }


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


def check_fits(path: str | Path, static: Mapping[str, Any], name: str) -> Adapter:
    """Read `path` against one backbone and apply its engine's pool checks; AdapterError if unfit."""
    from adapterserve.adapters_store.formats.read import read_adapter  # the readers import torch

    spec, limits = backbone_spec(static), AdapterLimits(**static["limits"])
    adapter = read_adapter(path, spec, limits, name=name)
    check_servable(adapter, name, ServingRules.from_dict(static["servable"]))
    check_family_files(Path(path), adapter, name)
    return adapter


def check_family_files(path: Path, adapter: Adapter, name: str) -> None:
    """Refuse weights or configs of another format beside the adapter's own (they would never be read)."""
    own = ADAPTERHUB_FILES if adapter.kind == "bottleneck" else PEFT_FILES
    present = {p.name for p in path.iterdir()} & ADAPTER_FILES
    if stray := sorted(present - own):
        raise AdapterError(
            f"adapter '{name}' is a {adapter.kind} adapter, which consists of {', '.join(sorted(own))}; "
            f"{stray[0]!r} belongs to another format: leave it out"
        )


def adapter_validator(statics: Sequence[Mapping[str, Any]], name: str) -> Callable[[Path], dict[str, Any]]:
    """A store validator: checks the staged copy against each served backbone in turn; records
    the first that fits as "backbone"; AdapterError naming each refusal if none does."""

    def validate(path: Path) -> dict[str, Any]:
        refusals = []
        for static in statics:
            try:
                return {**describe_adapter(check_fits(path, static, name)), "backbone": static["backbone_id"]}
            except AdapterError as exc:
                refusals.append(exc)
        if len(refusals) == 1:
            raise refusals[0]
        raise AdapterError("; ".join(f"for backbone {s['backbone_id']!r}: {e}" for s, e in zip(statics, refusals)))

    return validate
