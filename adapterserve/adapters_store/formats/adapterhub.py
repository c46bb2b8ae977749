"""AdapterHub bottleneck adapters (``adapters`` 1.3 ``model.save_adapter``): Houlsby and Pfeiffer.

Files: ``adapter_config.json`` (``config`` holds the BnConfig options) and
``adapter.safetensors`` (written with ``save_adapter(dir, name, use_safetensors=True)``;
the default ``pytorch_adapter.bin`` is a pickle and is refused, never opened). With
``with_head=True`` a flex-head model adds ``head_config.json`` and
``model_head.safetensors``: a classification head, read when present.

Weights per layer i and place: ``adapter_down.0`` [r, D] + bias [r], ``adapter_up``
[D, r] + bias [D], with r = int(D // reduction_factor) (at least 1), under
``[bert.|roberta.]encoder.layer.<i>.attention.output.adapters.<name>.`` (place "mh") and
``...encoder.layer.<i>.output.adapters.<name>.`` ("output") for BERT/RoBERTa, and
``[model.]layers.<i>.attention_adapters.adapters.<name>.`` / ``output_adapters`` for
Llama/Mistral. ``leave_out`` layers have none.

Where the adapters sit in adapters 1.3 (``BottleneckLayer.bottleneck_layer_forward``
-> ``Adapter.pre_forward`` / ``forward`` / ``post_forward``), for one layer, with
``ad(h) = (act(h @ W_down.T + b_down) @ W_up.T + b_up) * scaling`` and dropout off:

BERT / RoBERTa (post-LN; ``LN_att``, ``LN_out`` are the layer's own pre-trained
``attention.output.LayerNorm`` and ``output.LayerNorm``)::

    r1 = hidden                                            # layer input
    x1 = attention.output.dense(self_attention(r1))
    if mh adapter:                                         # Houlsby only (mh_adapter)
        h1 = LN_att(x1 + r1) if original_ln_before else x1  # Pfeiffer-style / Houlsby
        x1 = x1 + ad_mh(h1)                                # residual_before_ln: residual is x1
    hidden = LN_att(x1 + r1)                               # original_ln_after
    r2 = hidden
    x2 = output.dense(gelu(intermediate.dense(r2)))
    if output adapter:                                     # Houlsby and Pfeiffer
        h2 = LN_out(x2 + r2) if original_ln_before else x2  # Pfeiffer: LN_out applied twice
        x2 = x2 + ad_output(h2)
    hidden = LN_out(x2 + r2)

Llama / Mistral (pre-LN; the adapter layer gets ``layer_norm=None``)::

    r1 = hidden
    x1 = o_proj(self_attn(input_layernorm(r1)))
    if mh adapter:
        h1 = x1 + r1 if original_ln_before else x1
        x1 = x1 + ad_mh(h1)
    hidden = x1 + r1
    r2 = hidden
    x2 = down_proj(silu(gate_proj(n)) * up_proj(n)), n = post_attention_layernorm(r2)
    if output adapter:
        h2 = x2 + r2 if original_ln_before else x2
        x2 = x2 + ad_output(h2)
    hidden = x2 + r2

Houlsby (``DoubleSeqBnConfig``: mh and output, original_ln_before=False, swish) and
Pfeiffer (``SeqBnConfig``: output only, original_ln_before=True, relu) both use
residual_before_ln=True, original_ln_after=True and no LayerNorm of their own; other
values of those options, and parallel, gated, Compacter (PHM) and invertible
adapters, are refused. ``scaling`` is folded into the up-projection here.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.peft_common import read_safetensors
from adapterserve.adapters_store.formats.types import (
    BackboneSpec,
    BottleneckAdapter,
    BottleneckModule,
    ClassifierHead,
    HeadLayer,
)
from adapterserve.adapters_store.validate import check_finite
from adapterserve.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter.safetensors"
PICKLE_FILE = "pytorch_adapter.bin"
HEAD_CONFIG_FILE = "head_config.json"
HEAD_WEIGHTS_FILE = "model_head.safetensors"
HEAD_PICKLE_FILE = "pytorch_model_head.bin"

ENCODER_TYPES = ("bert", "roberta")
DECODER_TYPES = ("llama", "mistral")

# adapters' activation names (transformers' get_activation) -> the bottleneck op's names
ACTIVATIONS = {
    "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new",
    "swish": "silu", "silu": "silu", "tanh": "tanh",
}
_LEGACY_ACTIVATIONS = {"gelu": "gelu_new", "gelu_orig": "gelu"}  # configs without "version" (adapter-transformers 2)

# option -> (the only value served, why others are refused); absent options take adapters' BnConfig default
_FIXED = {
    "original_ln_after": (True, "original_ln_after=false (no residual/LayerNorm after the adapter) is not supported"),
    "residual_before_ln": (True, "residual_before_ln other than true is not supported (Houlsby and Pfeiffer use true)"),
    "ln_before": (False, "ln_before=true (the adapter's own LayerNorm) is not supported"),
    "ln_after": (False, "ln_after=true (the adapter's own LayerNorm) is not supported"),
    "is_parallel": (False, "parallel adapters (is_parallel, ParBnConfig) are not supported yet"),
    "use_gating": (False, "gated adapters (use_gating, e.g. UniPELT) are not supported"),
    "phm_layer": (False, "Compacter adapters (phm_layer) are not supported"),
    "inv_adapter": (None, "invertible adapters (inv_adapter, e.g. seq_bn_inv) are not supported"),
    "cross_adapter": (False, "cross-attention adapters (cross_adapter) are not supported"),
}
# options that change nothing at inference (training-only, or PHM settings while phm_layer is false)
_INERT = {
    "architecture", "init_weights", "init_weights_seed", "dropout", "stochastic_depth", "adapter_residual_before_ln",
    "inv_adapter_reduction_factor", "phm_dim", "factorized_phm_W", "shared_W_phm", "shared_phm_rule",
    "factorized_phm_rule", "phm_c_init", "phm_init_range", "learn_phm", "hypercomplex_nonlinearity", "phm_rank",
    "phm_bias",
}
_KNOWN = set(_FIXED) | _INERT | {
    "mh_adapter", "output_adapter", "reduction_factor", "non_linearity", "original_ln_before", "scaling", "leave_out",
}
_PLACES = {"attention.output": "mh", "output": "output", "attention_adapters": "mh", "output_adapters": "output"}
_ENCODER_KEY = re.compile(
    r"^(?:(?:bert|roberta)\.)?encoder\.layer\.(?P<layer>\d+)\.(?P<place>attention\.output|output)"
    r"\.adapters\.(?P<name>[^.]+)\.(?P<part>adapter_down\.0|adapter_up)\.(?P<param>weight|bias)$"
)
_DECODER_KEY = re.compile(
    r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<place>attention_adapters|output_adapters)"
    r"\.adapters\.(?P<name>[^.]+)\.(?P<part>adapter_down\.0|adapter_up)\.(?P<param>weight|bias)$"
)
_HEAD_KEY = re.compile(r"^heads\.(?P<name>[^.]+)\.(?P<index>\d+)\.(?P<param>weight|bias)$")


def read_adapterhub(
    path: str | Path, spec: BackboneSpec, max_rank: int, *, name: str | None = None
) -> BottleneckAdapter:
    """Read and check an AdapterHub bottleneck adapter directory against ``spec``.

    Raises ``AdapterError`` for anything unfit. ``name`` is used in messages
    (default: the directory name). The head is read when ``head_config.json`` exists.
    """
    root = Path(path)
    name = name or root.name
    if not root.is_dir():
        raise AdapterError(f"adapter '{name}': {root} is not a directory")
    full = _read_json(root / CONFIG_FILE, name, "is it an AdapterHub adapter directory?")
    config = _check_config(name, full, spec)
    how = "model.save_adapter(dir, name, use_safetensors=True)"
    tensors = _read_tensors(root, WEIGHTS_FILE, PICKLE_FILE, name, how)
    modules = _modules(name, config, full["name"], tensors, spec, max_rank)
    head = _read_head(root, name, spec) if (root / HEAD_CONFIG_FILE).exists() else None
    return BottleneckAdapter(
        modules=modules, original_ln_before=config["original_ln_before"], config=full, head=head
    )


# config


def _read_json(file: Path, name: str, hint: str) -> dict:
    if not file.is_file():
        raise AdapterError(f"adapter '{name}' has no {file.name} in {file.parent}; {hint}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter '{name}': {file.name} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise AdapterError(f"adapter '{name}': {file.name} must hold a JSON object")
    return data


def _check_config(name: str, full: dict, spec: BackboneSpec) -> dict:
    """The bottleneck options with adapters' defaults filled in; refuses what is not served."""
    config = full.get("config")
    if not isinstance(config, dict):
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} needs 'config' as an object of adapter options")
    if not isinstance(full.get("name"), str) or not full["name"]:
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} has no 'name' (the name the weights are saved under)")
    _check_backbone(name, full, spec)
    architecture = config.get("architecture")
    if architecture is not None:
        raise AdapterError(
            f"adapter '{name}': AdapterHub '{architecture}' adapters are not supported here; only bottleneck "
            "adapters (Houlsby / Pfeiffer) are read from the adapters format (use PEFT's for LoRA, IA3, prefixes)"
        )
    unknown = sorted(set(config) - _KNOWN)
    if unknown:
        raise AdapterError(
            f"adapter '{name}': unknown option '{unknown[0]}' in {CONFIG_FILE}; it may come from a newer adapters "
            "version whose meaning is not served here"
        )
    for option, (value, message) in _FIXED.items():
        got = config.get(option, value)
        if got is not value:
            raise AdapterError(f"adapter '{name}': {message} (found {option}={got!r})")
    return {
        **config,
        "mh_adapter": _flag(name, config, "mh_adapter", None),
        "output_adapter": _flag(name, config, "output_adapter", None),
        "original_ln_before": _flag(name, config, "original_ln_before", False),
        "scaling": _scaling(name, config.get("scaling", 1.0)),
        "leave_out": _leave_out(name, config.get("leave_out", [])),
        "non_linearity": _activation(name, config.get("non_linearity"), legacy="version" not in full),
    }


def _check_backbone(name: str, full: dict, spec: BackboneSpec) -> None:
    if spec.model_type not in ENCODER_TYPES + DECODER_TYPES:
        raise AdapterError(
            f"adapter '{name}': bottleneck adapters are not served on {spec.model_type} backbones "
            f"(supported: {', '.join(ENCODER_TYPES + DECODER_TYPES)})"
        )
    for key, want in (("model_type", spec.model_type), ("hidden_size", spec.hidden_size)):
        got = full.get(key)
        if got is not None and got != want:
            raise AdapterError(
                f"adapter '{name}' was saved for {key}={got!r} but the backbone has {want!r}; "
                "was it made for another model?"
            )


def _flag(name: str, config: dict, option: str, default: bool | None) -> bool:
    value = config.get(option, default)
    if not isinstance(value, bool):
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} needs {option} as true or false, got {value!r}")
    return value


def _scaling(name: str, value: object) -> float:
    if isinstance(value, str):
        raise AdapterError(f"adapter '{name}': scaling={value!r} (a learned scaling) is not supported yet")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} needs scaling as a finite number, got {value!r}")
    return float(value)


def _leave_out(name: str, value: object) -> set[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise AdapterError(
            f"adapter '{name}': {CONFIG_FILE} needs leave_out as a list of layer indices, got {value!r}"
        )
    return set(value)


def _activation(name: str, value: object, legacy: bool) -> str:
    if isinstance(value, str) and legacy:
        value = _LEGACY_ACTIVATIONS.get(value.lower(), value)
    if not isinstance(value, str) or value.lower() not in ACTIVATIONS:
        raise AdapterError(
            f"adapter '{name}': non_linearity {value!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[value.lower()]


def _expected_rank(name: str, config: dict, layer: int, hidden: int) -> int:
    """adapters' width at one layer: int(hidden // reduction_factor), at least 1."""
    factor = config.get("reduction_factor")
    if isinstance(factor, dict):
        factor = factor.get(str(layer), factor.get("default"))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise AdapterError(
            f"adapter '{name}': {CONFIG_FILE} needs reduction_factor as a positive number (or a mapping with a "
            f"'default'), none found for layer {layer}"
        )
    return max(1, int(hidden // factor))


# weights


def _read_tensors(root: Path, file_name: str, pickle_name: str, name: str, how: str) -> dict[str, torch.Tensor]:
    return read_safetensors(root, file_name, pickle_name, name, f" with the adapters library: {how}")


def _parts(name: str, saved_name: str, tensors: dict[str, torch.Tensor], spec: BackboneSpec):
    """(layer, place) -> {"down.weight": ..., ...} as stored; refuses any other tensor."""
    pattern = _ENCODER_KEY if spec.model_type in ENCODER_TYPES else _DECODER_KEY
    encoder = pattern is _ENCODER_KEY
    layout = "encoder.layer.<i>.<attention.output|output>" if encoder else "layers.<i>.<attention|output>_adapters"
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = pattern.match(key)
        if match is None:
            raise AdapterError(
                f"adapter '{name}' has an unexpected tensor '{key}' in {WEIGHTS_FILE}; expected only "
                f"{layout}.adapters.{saved_name}.adapter_down.0/adapter_up weights and biases for {spec.model_type}"
            )
        if match["name"] != saved_name:
            raise AdapterError(
                f"adapter '{name}': {WEIGHTS_FILE} holds weights of adapter '{match['name']}' but {CONFIG_FILE} "
                f"names '{saved_name}'; the config does not belong to these weights"
            )
        part = ("down." if match["part"] == "adapter_down.0" else "up.") + match["param"]
        found.setdefault((int(match["layer"]), _PLACES[match["place"]]), {})[part] = tensor
    return found


def _modules(name: str, config: dict, saved_name: str, tensors, spec: BackboneSpec, max_rank: int):
    found = _parts(name, saved_name, tensors, spec)
    places = [p for p, on in (("mh", config["mh_adapter"]), ("output", config["output_adapter"])) if on]
    if not places:
        raise AdapterError(f"adapter '{name}' has neither mh_adapter nor output_adapter set; it adapts nothing")
    expected = {(i, p) for i in range(spec.num_layers) if i not in config["leave_out"] for p in places}
    extra, missing = sorted(set(found) - expected), sorted(expected - set(found))
    if extra:
        layer, place = extra[0]
        why = f"the backbone has {spec.num_layers} layers" if layer >= spec.num_layers else "its config has none there"
        raise AdapterError(f"adapter '{name}' stores a bottleneck at layer {layer} ({place}) but {why}")
    if missing:
        layer, place = missing[0]
        raise AdapterError(
            f"adapter '{name}': {CONFIG_FILE} places a bottleneck at layer {layer} ({place}) but {WEIGHTS_FILE} "
            f"has no weights for it ({len(missing)} missing)"
        )
    return {addr: _module(name, config, addr, found[addr], spec, max_rank) for addr in sorted(expected)}


def _module(name: str, config: dict, addr: tuple[int, str], parts: dict, spec: BackboneSpec, max_rank: int):
    layer, place = addr
    where = f"layer {layer} ({place})"
    absent = [p for p in ("down.weight", "down.bias", "up.weight", "up.bias") if p not in parts]
    if absent:
        raise AdapterError(f"adapter '{name}' lacks {absent[0]} at {where}; {WEIGHTS_FILE} is incomplete")
    d, r = spec.hidden_size, _expected_rank(name, config, layer, spec.hidden_size)
    want = {"down.weight": (r, d), "down.bias": (r,), "up.weight": (d, r), "up.bias": (d,)}
    for part, shape in want.items():
        tensor = parts[part]
        if not tensor.is_floating_point():
            raise AdapterError(
                f"adapter '{name}' stores {part} at {where} as {tensor.dtype}; it must be floating point"
            )
        if tuple(tensor.shape) != shape:
            raise AdapterError(
                f"adapter '{name}' has {part} of shape {tuple(tensor.shape)} at {where}, expected {shape} for "
                f"hidden size {d} and reduction_factor {config.get('reduction_factor')!r}; "
                "was it made for another model?"
            )
        check_finite(name, f"{where} {part}", tensor)
    if r > max_rank:
        raise AdapterError(
            f"adapter '{name}' has a bottleneck of width {r} at {where}, above the maximum {max_rank} this engine "
            "was started with; restart it with a larger maximum or use a larger reduction_factor"
        )
    s = config["scaling"]
    return BottleneckModule(
        down=parts["down.weight"].float().contiguous(),
        down_bias=parts["down.bias"].float().contiguous(),
        up=(parts["up.weight"].float().T * s).contiguous(),
        up_bias=(parts["up.bias"].float() * s).contiguous(),
        activation=config["non_linearity"],
    )


# classification head


def _read_head(root: Path, name: str, spec: BackboneSpec) -> ClassifierHead:
    full = _read_json(root / HEAD_CONFIG_FILE, name, "")
    config = full.get("config")
    if not isinstance(config, dict) or config.get("head_type") != "classification":
        kind = config.get("head_type") if isinstance(config, dict) else config
        raise AdapterError(
            f"adapter '{name}': only classification heads are supported, {HEAD_CONFIG_FILE} has {kind!r}"
        )
    if spec.model_type not in ENCODER_TYPES:
        raise AdapterError(f"adapter '{name}': AdapterHub heads on {spec.model_type} backbones are not supported yet")
    _check_backbone(name, full, spec)
    layers, labels = _head_shape(name, config)
    how = "model.save_adapter(dir, name, with_head=True, use_safetensors=True)"
    tensors = _read_tensors(root, HEAD_WEIGHTS_FILE, HEAD_PICKLE_FILE, name, how)
    head_name = full.get("name")
    weights = {}
    for key, tensor in tensors.items():
        match = _HEAD_KEY.match(key)
        if match is None or match["name"] != head_name:
            raise AdapterError(
                f"adapter '{name}' has an unexpected tensor '{key}' in {HEAD_WEIGHTS_FILE} (head '{head_name}')"
            )
        weights[(int(match["index"]), match["param"])] = tensor
    built = _head_layers(name, config, layers, labels, weights, spec.hidden_size)
    pooling = "pooler" if config.get("use_pooler") else "cls"
    return ClassifierHead(layers=built, pooling=pooling, id2label=_id2label(name, config, labels))


def _head_shape(name: str, config: dict) -> tuple[int, int]:
    layers, labels = config.get("layers"), config.get("num_labels")
    for what, value in (("layers", layers), ("num_labels", labels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AdapterError(
                f"adapter '{name}': {HEAD_CONFIG_FILE} needs {what} as a positive integer, got {value!r}"
            )
    if not isinstance(config.get("use_pooler", False), bool):
        raise AdapterError(f"adapter '{name}': {HEAD_CONFIG_FILE} needs use_pooler as true or false")
    return layers, labels


def _head_layers(name: str, config: dict, layers: int, labels: int, weights: dict, hidden: int):
    """adapters' PredictionHead: (Dropout, Linear D->D, act) * (layers - 1), Dropout, Linear D->labels."""
    act_name = config.get("activation_function")
    activation = _activation(name, act_name, legacy=False) if act_name else None
    built, index, used = [], 0, set()
    for layer in range(layers):
        last = layer == layers - 1
        index += 1  # past the Dropout, to the Linear
        out, bias = (labels, config.get("bias", True)) if last else (hidden, True)
        weight = _head_tensor(name, weights, (index, "weight"), (out, hidden))
        bias_t = _head_tensor(name, weights, (index, "bias"), (out,)) if bias else None
        used |= {(index, "weight"), (index, "bias")} if bias else {(index, "weight")}
        built.append(HeadLayer(weight=weight, bias=bias_t, activation=None if last else activation))
        index += 1 if last or activation is None else 2
    extra = sorted(set(weights) - used)
    if extra:
        raise AdapterError(f"adapter '{name}': {HEAD_WEIGHTS_FILE} has weights at position {extra[0]} that a "
                           f"{layers}-layer head does not have")
    return tuple(built)


def _head_tensor(name: str, weights: dict, key: tuple[int, str], shape: tuple[int, ...]) -> torch.Tensor:
    tensor = weights.get(key)
    if tensor is None:
        raise AdapterError(f"adapter '{name}': {HEAD_WEIGHTS_FILE} lacks the head's {key[0]}.{key[1]}")
    if not tensor.is_floating_point() or tuple(tensor.shape) != shape:
        raise AdapterError(
            f"adapter '{name}' has head tensor {key[0]}.{key[1]} of shape {tuple(tensor.shape)} ({tensor.dtype}), "
            f"expected {shape}; was it made for another model?"
        )
    check_finite(name, f"head {key[0]}.{key[1]}", tensor)
    return tensor.float().contiguous()


def _id2label(name: str, config: dict, labels: int) -> dict[int, str]:
    label2id = config.get("label2id")
    if label2id is None:
        return {i: f"LABEL_{i}" for i in range(labels)}
    ids = list(label2id.values()) if isinstance(label2id, dict) else None
    if ids is None or not all(type(i) is int for i in ids) or sorted(ids) != list(range(labels)):
        raise AdapterError(
            f"adapter '{name}': {HEAD_CONFIG_FILE} label2id must map {labels} labels to the ids 0..{labels - 1}"
        )
    return {i: label for label, i in label2id.items()}
