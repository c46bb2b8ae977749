"""What every PEFT reader shares: the config file and the safetensors weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from adapterserve.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"


def read_config(root: Path, name: str) -> dict:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"adapter '{name}' has no {CONFIG_FILE} in {root}; is it a PEFT adapter directory?")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} must hold a JSON object")
    return config


def read_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors; a pickle-only directory is refused without opening it."""
    return read_safetensors(root, WEIGHTS_FILE, PICKLE_FILE, name,
                            ": PeftModel.from_pretrained(...).save_pretrained(dir, safe_serialization=True)")


def read_safetensors(root: Path, file_name: str, pickle_name: str, name: str, resave: str) -> dict[str, torch.Tensor]:
    """Tensors of ``root/file_name``; if only ``pickle_name`` is there it is refused, never
    opened, with ``resave`` telling how to convert it (appended to the message)."""
    file = root / file_name
    if not file.is_file():
        if (root / pickle_name).exists():
            raise AdapterError(
                f"adapter '{name}' has only {pickle_name}, a pickle, which is never loaded here (it can run "
                f"code); re-save it as safetensors in a trusted environment{resave}"
            )
        raise AdapterError(f"adapter '{name}' has no {file_name} in {root}")
    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter '{name}': {file_name} is not a readable safetensors file ({exc})") from exc


def config_int(name: str, config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} needs {key} as a positive integer, got {value!r}")
    return value
