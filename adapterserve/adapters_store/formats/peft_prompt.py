"""PEFT prompt-learning adapters: prompt tuning, P-tuning and prefix tuning.

All three save one tensor, ``prompt_embeddings``, already final (P-tuning's
encoder and prefix tuning's projection are applied before saving):
  PROMPT_TUNING, P_TUNING: [P, hidden], virtual-token input embeddings.
  PREFIX_TUNING: [P, layers * 2 * kv_heads * head_dim]; per layer, key then value.
"""
from __future__ import annotations

from pathlib import Path

import torch

from adapterserve.adapters_store.formats.families import Adapter, PrefixAdapter, PromptAdapter
from adapterserve.adapters_store.formats.peft_head import check_modules_to_save, is_head_key
from adapterserve.adapters_store.formats.peft_common import CONFIG_FILE, config_int, read_config, read_weights
from adapterserve.adapters_store.formats.types import BackboneSpec
from adapterserve.adapters_store.validate import check_finite
from adapterserve.errors import AdapterError

PROMPT_TYPES = {"PROMPT_TUNING": "prompt_tuning", "P_TUNING": "p_tuning", "PREFIX_TUNING": "prefix_tuning"}


def read_peft_prompt(path: str | Path, spec: BackboneSpec, max_virtual_tokens: int, *, name: str | None = None) -> Adapter:
    root = Path(path)
    name = name or root.name
    config = read_config(root, name)
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type not in PROMPT_TYPES:
        raise AdapterError(f"adapter '{name}': peft_type {peft_type or None} is not a prompt-learning type")
    if config.get("num_transformer_submodules", 1) != 1:
        raise AdapterError(f"adapter '{name}': num_transformer_submodules must be 1 (encoder-decoder models are not served)")
    num_virtual = config_int(name, config, "num_virtual_tokens")
    if num_virtual > max_virtual_tokens:
        raise AdapterError(
            f"adapter '{name}' has {num_virtual} virtual tokens; this server accepts at most {max_virtual_tokens}"
        )
    check_modules_to_save(name, config)
    tensors = {k: v for k, v in read_weights(root, name).items() if not is_head_key(k)}
    if set(tensors) != {"prompt_embeddings"}:
        raise AdapterError(f"adapter '{name}': expected only 'prompt_embeddings' in its weights, found {sorted(tensors)}")
    embeddings = tensors["prompt_embeddings"]
    if not embeddings.is_floating_point():
        raise AdapterError(f"adapter '{name}': prompt_embeddings must be floating point, got {embeddings.dtype}")
    check_finite(name, "prompt_embeddings", embeddings)
    embeddings = embeddings.to(torch.float32)
    kind = PROMPT_TYPES[peft_type]
    if kind == "prefix_tuning":
        return Adapter(kind, prefix=_prefix(name, embeddings, num_virtual, spec), config=config)
    _check_shape(name, embeddings, (num_virtual, spec.hidden_size), "[num_virtual_tokens, hidden_size]")
    return Adapter(kind, prompt=PromptAdapter(embeddings), config=config)


def _prefix(name: str, embeddings: torch.Tensor, num_virtual: int, spec: BackboneSpec) -> PrefixAdapter:
    layers, heads, dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
    _check_shape(name, embeddings, (num_virtual, layers * 2 * heads * dim),
                 f"[num_virtual_tokens, layers*2*kv_heads*head_dim = {layers}*2*{heads}*{dim}]")
    kv = embeddings.view(num_virtual, layers, 2, heads, dim).permute(1, 2, 0, 3, 4)  # [L, 2, P, H, D]
    return PrefixAdapter(keys=kv[:, 0].contiguous(), values=kv[:, 1].contiguous())


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(tensor.shape) != expected:
        raise AdapterError(
            f"adapter '{name}': prompt_embeddings has shape {tuple(tensor.shape)} but this backbone needs "
            f"{expected} {meaning}; was it made for another model? (see {CONFIG_FILE})"
        )
