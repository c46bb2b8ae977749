"""One entry point for every adapter format: picks the reader from the config."""
from __future__ import annotations

from pathlib import Path

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.host_dtype import in_dtype
from adapterserve.adapters_store.formats.peft_common import read_config, read_weights
from adapterserve.adapters_store.formats.peft_head import read_peft_head
from adapterserve.adapters_store.formats.peft_prompt import (
    PROMPT_TYPES,
    read_peft_prompt,
)
from adapterserve.adapters_store.formats.types import AdapterLimits, BackboneSpec
from adapterserve.errors import AdapterError

PEFT_TYPES = ("LORA", "IA3", *PROMPT_TYPES)


def read_adapter(path: str | Path, spec: BackboneSpec, limits: AdapterLimits, *, name: str | None = None,
                 dtype: torch.dtype | None = None) -> Adapter:
    """Read and check any supported adapter directory; AdapterError if unfit. `dtype`: the
    serving dtype its weights are kept in (default: float32, as read)."""
    root = Path(path)
    name = name or root.name
    if not root.is_dir():
        raise AdapterError(f"adapter '{name}': {root} is not a directory")
    config = read_config(root, name)
    adapter = _read_family(root, name, config, spec, limits)
    if config.get("modules_to_save") and str(config.get("peft_type") or "").upper() in PEFT_TYPES:
        adapter.head = read_peft_head(name, read_weights(root, name), config, spec)
    return adapter if dtype is None else in_dtype(adapter, dtype, name)


def _read_family(root: Path, name: str, config: dict, spec: BackboneSpec, limits: AdapterLimits) -> Adapter:
    peft_type = str(config.get("peft_type") or "").upper()
    if peft_type == "LORA":
        from adapterserve.adapters_store.formats.peft_lora import read_peft_lora

        lora = read_peft_lora(root, spec, limits.max_lora_rank, name=name)
        return Adapter("lora", lora=lora, config=config)
    if peft_type == "IA3":
        from adapterserve.adapters_store.formats.peft_ia3 import read_peft_ia3

        return read_peft_ia3(root, spec, name=name)
    if peft_type in PROMPT_TYPES:
        return read_peft_prompt(root, spec, limits.max_virtual_tokens, name=name)
    if not peft_type and isinstance(config.get("config"), dict):  # AdapterHub's format
        from adapterserve.adapters_store.formats.adapterhub import read_adapterhub

        bottleneck = read_adapterhub(root, spec, limits.max_bottleneck_rank, name=name)
        return Adapter("bottleneck", bottleneck=bottleneck, head=bottleneck.head, config=config)
    if peft_type:
        raise AdapterError(
            f"adapter '{name}': peft_type {peft_type} is not supported; supported: LORA, IA3, "
            f"{', '.join(PROMPT_TYPES)}"
        )
    raise AdapterError(f"adapter '{name}': {root}/adapter_config.json has no peft_type; is it a PEFT adapter?")
