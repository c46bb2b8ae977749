"""Classification heads trained with a PEFT adapter (``modules_to_save``).

PEFT's sequence-classification task saves the head beside the adapter, e.g.
``base_model.model.score.weight`` (decoders: one linear on the last token),
``base_model.model.classifier.weight``/``bias`` (BERT: on the pooler output), or
``classifier.dense`` + ``classifier.out_proj`` (RoBERTa: dense, tanh, out_proj on
the first token). Label names come from ``id2label`` in adapter_config.json when
present (PEFT keeps unknown keys there), else LABEL_<i>.
"""
from __future__ import annotations

import re

import torch

from adapterserve.adapters_store.formats.types import BackboneSpec, ClassifierHead, HeadLayer
from adapterserve.adapters_store.validate import check_finite
from adapterserve.errors import AdapterError

HEAD_MODULES = ("classifier", "score")
_HEAD_KEY = re.compile(r"^base_model\.(?:model\.)?(?P<path>(?:classifier|score)\..+)$")


def check_modules_to_save(name: str, config: dict) -> None:
    """Only a classification head may be saved whole with an adapter."""
    saved = config.get("modules_to_save") or []
    if isinstance(saved, str) or not isinstance(saved, list):
        raise AdapterError(f"adapter '{name}': modules_to_save must be a list, got {saved!r}")
    other = sorted(set(saved) - set(HEAD_MODULES))
    if other:
        raise AdapterError(
            f"adapter '{name}': modules_to_save {other} is not supported: only a classification head "
            f"({' or '.join(HEAD_MODULES)}) can be served per adapter; retrain without the others"
        )


def is_head_key(key: str) -> bool:
    return _HEAD_KEY.match(key) is not None


def read_peft_head(name: str, tensors: dict[str, torch.Tensor], config: dict, spec: BackboneSpec) -> ClassifierHead | None:
    """The head among an adapter's tensors, or None if it has none."""
    found = {}
    for key, tensor in tensors.items():
        match = _HEAD_KEY.match(key)
        if match:
            path = match["path"].replace(".modules_to_save.default", "")
            found[path] = tensor
    if not found:
        return None
    check_modules_to_save(name, config)
    for path, tensor in found.items():
        check_finite(name, path, tensor)
    layers, pooling = _layers(name, found, spec)
    return ClassifierHead(layers=layers, pooling=pooling, id2label=_labels(name, config, layers[-1].weight.shape[0]))


def _layers(name: str, found: dict[str, torch.Tensor], spec: BackboneSpec) -> tuple[tuple[HeadLayer, ...], str]:
    if set(found) <= {"score.weight", "score.bias"}:
        return (_layer(name, found, "score", spec.hidden_size, None),), "last"
    if set(found) <= {"classifier.weight", "classifier.bias"}:
        return (_layer(name, found, "classifier", spec.hidden_size, None),), "pooler"
    if set(found) == {f"classifier.{m}.{p}" for m in ("dense", "out_proj") for p in ("weight", "bias")}:
        dense = _layer(name, found, "classifier.dense", spec.hidden_size, "tanh")
        return (dense, _layer(name, found, "classifier.out_proj", spec.hidden_size, None)), "cls"
    raise AdapterError(f"adapter '{name}' saves a head of unknown layout: {sorted(found)}")


def _layer(name: str, found: dict[str, torch.Tensor], module: str, hidden: int, activation: str | None) -> HeadLayer:
    weight = found.get(f"{module}.weight")
    bias = found.get(f"{module}.bias")
    if weight is None or weight.dim() != 2 or weight.shape[1] != hidden:
        shape = None if weight is None else tuple(weight.shape)
        raise AdapterError(
            f"adapter '{name}': head {module}.weight has shape {shape}; this backbone needs [labels, {hidden}]"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise AdapterError(f"adapter '{name}': head {module}.bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    return HeadLayer(weight.float(), None if bias is None else bias.float(), activation)


def _labels(name: str, config: dict, num_labels: int) -> dict[int, str]:
    raw = config.get("id2label")
    if raw is None:
        return {i: f"LABEL_{i}" for i in range(num_labels)}
    try:
        labels = {int(k): str(v) for k, v in dict(raw).items()}
    except (TypeError, ValueError) as exc:
        raise AdapterError(f"adapter '{name}': id2label must map label indices to names ({exc})") from exc
    if sorted(labels) != list(range(num_labels)):
        raise AdapterError(f"adapter '{name}': id2label has {len(labels)} entries for a head of {num_labels} labels")
    return labels
