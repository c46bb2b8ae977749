"""PEFT LoRA directories (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT saves one ``lora_A`` [r, in] and one ``lora_B`` [out, r] per adapted linear,
under keys like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``
(older tools keep the adapter name: ``...lora_A.default.weight``). The config gives
the scaling: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), with per-module ``r``
and ``lora_alpha`` from ``rank_pattern`` / ``alpha_pattern``, matched the way PEFT
matches them. Pickled weights (``adapter_model.bin``) are refused, never opened.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.types import BackboneSpec, LoraAdapter, LoraModule
from adapterserve.adapters_store.validate import check_kind, check_lora_adapter, module_name, parent_of
from adapterserve.adapters_store.formats.peft_common import CONFIG_FILE, WEIGHTS_FILE, read_config, read_weights
from adapterserve.adapters_store.formats.peft_head import check_modules_to_save, is_head_key
from adapterserve.errors import AdapterError


# Config options that change what LoRA computes; each is refused when set.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora) is not supported yet; retrain as plain LoRA or merge it into the model",
    "fan_in_fan_out": "fan_in_fan_out=true (GPT-2 style Conv1D weights) is not supported",
    "lora_bias": "lora_bias=true (a bias on lora_B) is not supported yet",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported yet",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported yet",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported yet",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported yet",
    "velora_config": "the VeLoRA variant (velora_config) is not supported yet",
    "monteclora_config": "the MonteCLoRA variant (monteclora_config) is not supported yet",
    "use_bdlora": "the BD-LoRA variant (use_bdlora) is not supported yet",
    "arrow_config": "Arrow routing (arrow_config) is not supported yet",
    "kasa_config": "the KaSA variant (kasa_config) is not supported yet",
    "megatron_config": "Megatron parallel LoRA layers (megatron_config) are not supported",
}
# JSON types PEFT writes for the options read here (None: absent or null).
_OPTION_TYPES = {
    "target_modules": (str, list),
    "exclude_modules": (str, list, type(None)),
    "rank_pattern": (dict, type(None)),
    "alpha_pattern": (dict, type(None)),
    "layers_to_transform": (int, list, type(None)),
    "layers_pattern": (str, list, type(None)),
}
# Initialisations that rewrite the base weights; such adapters fit only that rewritten base.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_LAYER_MODULE = re.compile(r"^(?:[a-z_]+\.)*?(?:layers|layer)\.(?P<layer>\d+)\.(?P<rest>.+)$")
_WHOLE_MODULES = ("embed_tokens", "lm_head")  # LoRA there is not served yet


def read_peft_lora(path: str | Path, spec: BackboneSpec, max_rank: int, *, name: str | None = None) -> LoraAdapter:
    """Read and check a PEFT LoRA directory against ``spec``; ``AdapterError`` if unfit.

    ``name`` is used in messages (default: the directory name).
    """
    root = Path(path)
    name = name or root.name
    if not root.is_dir():
        raise AdapterError(f"adapter '{name}': {root} is not a directory")
    config = _read_config(root, name)
    pairs = _read_pairs(root, name, spec)
    try:
        modules = {addr: _module(name, config, addr, a, b, spec) for addr, (a, b) in pairs.items()}
        adapter = LoraAdapter(modules=modules, config=config)
        check_lora_adapter(name, adapter, spec, max_rank)
        _check_targets(name, config, spec, set(modules))
    except re.error as exc:
        raise AdapterError(f"adapter '{name}': a pattern in {CONFIG_FILE} is not a valid regex ({exc})") from exc
    return adapter


# config


def _read_config(root: Path, name: str) -> dict:
    config = read_config(root, name)
    _check_supported(name, config)
    return config


def _check_supported(name: str, config: dict) -> None:
    peft_type = config.get("peft_type")
    if peft_type is None:
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} has no peft_type; is it a PEFT adapter?")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"adapter '{name}': peft_type {peft_type} is not supported yet (only LORA is)")
    check_modules_to_save(name, config)
    for option, message in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise AdapterError(f"adapter '{name}': {message} (found {option}={config[option]!r})")
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"adapter '{name}': bias={config['bias']!r} trains the backbone's own biases, which a shared "
            "backbone cannot take per adapter; only bias='none' is supported"
        )
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_CHANGING_INITS):
        raise AdapterError(
            f"adapter '{name}' was saved with init_lora_weights={config['init_lora_weights']!r}, which also "
            "changes the backbone's weights, so it does not fit the original backbone; re-save it with "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...) to get a plain LoRA"
        )
    if config.get("target_modules") is None:
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} has no target_modules")
    for option, types in _OPTION_TYPES.items():
        if not isinstance(config.get(option), types):
            raise AdapterError(f"adapter '{name}': {CONFIG_FILE} has {option}={config[option]!r}, not a valid value")
    _positive_int(name, "r", config.get("r"))
    _number(name, "lora_alpha", config.get("lora_alpha"))


def _positive_int(name: str, what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} needs {what} as a positive integer, got {value!r}")
    return value


def _number(name: str, what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} needs {what} as a finite number, got {value!r}")
    return float(value)


# weights


def _read_pairs(root: Path, name: str, spec: BackboneSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, kind) -> (lora_A, lora_B) as stored; refuses keys that are not LoRA on a
    backbone projection (a classification head's tensors are read by peft_head)."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in read_weights(root, name).items():
        if is_head_key(key):
            continue
        layer, kind, part = _parse_key(name, key, spec)
        parts = found.setdefault((layer, kind), {})
        if part in parts:
            raise AdapterError(f"adapter '{name}' has two lora_{part} tensors for {module_name(layer, kind)}")
        parts[part] = tensor
    pairs = {}
    for (layer, kind), parts in sorted(found.items()):
        for part, other in (("A", "B"), ("B", "A")):
            if part not in parts:
                raise AdapterError(
                    f"adapter '{name}' has lora_{other} but no lora_{part} for {module_name(layer, kind)}; "
                    f"{WEIGHTS_FILE} is incomplete"
                )
        pairs[(layer, kind)] = (parts["A"], parts["B"])
    return pairs


def _parse_key(name: str, key: str, spec: BackboneSpec) -> tuple[int, str, str]:
    if ".lora_embedding_" in key:
        raise AdapterError(f"adapter '{name}': LoRA on embeddings is not supported yet (found {key})")
    whole = next((part for part in key.split(".") if part in _WHOLE_MODULES), None)
    if whole is not None:
        raise AdapterError(f"adapter '{name}': LoRA on {whole} is not supported yet (found {key})")
    match = _LORA_KEY.match(key)
    module = match["module"].removeprefix("base_model.model.") if match else ""
    address = _LAYER_MODULE.match(module)
    kind = _kind_of(address["rest"], spec) if address else None
    if kind is None:
        raise AdapterError(
            f"adapter '{name}' has an unexpected tensor '{key}' in {WEIGHTS_FILE}; expected only "
            "...layers.<i>.<module>.lora_A.weight and ...lora_B.weight on the backbone's projections"
        )
    return int(address["layer"]), kind, match["part"]


def _kind_of(rest: str, spec: BackboneSpec) -> str | None:
    """Module kind for the path below ``layers.<i>.``; None if the path is malformed."""
    if rest in spec.linear_shapes:
        return rest  # encoder kinds are whole paths, e.g. attention.self.query
    parent, _, kind = rest.rpartition(".")
    if "." in parent or not parent or parent_of(kind) not in (None, parent):
        return None
    return kind


def _module(name: str, config: dict, addr: tuple[int, str], a: torch.Tensor, b: torch.Tensor,
            spec: BackboneSpec) -> LoraModule:
    key = _peft_key(*addr, spec)
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(
            f"adapter '{name}' stores {module_name(*addr)} as {a.dtype}/{b.dtype}; LoRA weights must be floating point"
        )
    r = _positive_int(name, f"rank_pattern[{key}]", _pattern_value(config.get("rank_pattern"), key, config["r"]))
    alpha = _number(name, "lora_alpha", _pattern_value(config.get("alpha_pattern"), key, config["lora_alpha"]))
    if a.dim() == 2 and a.shape[0] != r:
        raise AdapterError(
            f"adapter '{name}': {CONFIG_FILE} gives rank {r} for {module_name(*addr)} but its lora_A has "
            f"rank {a.shape[0]} (shape {tuple(a.shape)}); the config does not belong to these weights"
        )
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return LoraModule(a=a.to(torch.float32), b=b.to(torch.float32), scaling=scaling)


# PEFT's matching rules, applied to the module names of a *ForCausalLM model


def _peft_key(layer: int, kind: str, spec: BackboneSpec) -> str:
    """The module's name in the Hugging Face model, as PEFT matched targets against it."""
    parent = parent_of(kind)
    return f"{spec.layers_prefix}.{layer}.{parent + '.' if parent else ''}{kind}"


def _pattern_value(patterns: dict | None, key: str, default: object) -> object:
    """PEFT's ``get_pattern_key``: the first pattern that ends ``key`` at a dot boundary."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _targeted(config: dict, key: str) -> bool:
    """PEFT's ``check_target_module_exists`` for one module name."""
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, key):
        return False
    if isinstance(exclude, list) and (key in exclude or any(key.endswith(f".{e}") for e in exclude)):
        return False
    target = config["target_modules"]
    if isinstance(target, str):
        return target == "all-linear" or re.fullmatch(target, key) is not None
    if key in target:
        return True
    found = any(key.endswith(f".{t}") for t in target)
    layers = config.get("layers_to_transform")
    if not found or layers is None or layers == []:
        return found
    index = _layer_index(key, config.get("layers_pattern"))
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def _layer_index(key: str, layers_pattern: str | list[str] | None) -> int | None:
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        patterns = [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern
        match = next(
            (m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key))), None
        )
    return int(match["idx"]) if match else None


def _check_targets(name: str, config: dict, spec: BackboneSpec, stored: set[tuple[int, str]]) -> None:
    """The config's targets exist in the backbone and are exactly the modules stored."""
    backbone = {
        _peft_key(layer, kind, spec): (layer, kind)
        for layer in range(spec.num_layers)
        for kind in spec.linear_shapes
    }
    target = config["target_modules"]
    if isinstance(target, list):
        for entry in target:
            _check_target_entry(name, str(entry), spec, list(backbone))
    targeted = {addr for key, addr in backbone.items() if _targeted(config, key)}
    extra, missing = sorted(stored - targeted), sorted(targeted - stored)
    if extra:
        raise AdapterError(
            f"adapter '{name}' stores weights for {module_name(*extra[0])}, which its {CONFIG_FILE} does not "
            f"target (target_modules={target!r}); the config does not belong to these weights"
        )
    if missing:
        raise AdapterError(
            f"adapter '{name}' targets {module_name(*missing[0])} in {CONFIG_FILE} but {WEIGHTS_FILE} has no "
            f"lora_A/lora_B for it ({len(missing)} module(s) missing)"
        )


def _check_target_entry(name: str, entry: str, spec: BackboneSpec, backbone: list[str]) -> None:
    if any(key == entry or key.endswith(f".{entry}") for key in backbone):
        return
    if entry.split(".")[-1] in _WHOLE_MODULES:
        raise AdapterError(f"adapter '{name}': LoRA on {entry} is not supported yet (in target_modules)")
    check_kind(name, entry, spec)  # raises: the backbone has no such module
    raise AdapterError(f"adapter '{name}' targets '{entry}', which matches no module of this backbone")
