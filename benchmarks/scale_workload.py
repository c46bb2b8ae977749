"""The scale benchmark's inputs: random LoRA directories in PEFT's layout, and one fixed
request list (adapters drawn Zipf over the adapters; prompts of random token ids).

Adapters: rank r on `targets` of every layer, written straight as PEFT saves them
(adapter_config.json + adapter_model.safetensors, bfloat16). A few random tensor sets
are shared and each adapter gets its own lora_alpha, so every adapter has its own
content hash (the server's identity of an adapter) at the cost of writing files only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

TENSOR_SETS = 4  # distinct random weight sets shared by the adapters


@dataclass(frozen=True)
class Request:
    adapter: int | None  # index into the adapters; None: the base model
    prompt: list[int]
    max_tokens: int


def adapter_name(index: int) -> str:
    return f"z{index:04d}"


def _projection_shapes(model_dir: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, projection -> (in_features, out_features)) from the checkpoint's config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv, inter = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim, cfg["intermediate_size"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return cfg["num_hidden_layers"], shapes


def _module(kind: str) -> str:
    return f"mlp.{kind}" if kind in ("gate_proj", "up_proj", "down_proj") else f"self_attn.{kind}"


def _tensor_set(layers: int, shapes: dict[str, tuple[int, int]], targets: tuple[str, ...], rank: int,
                seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for kind in targets:
            fan_in, fan_out = shapes[kind]
            key = f"base_model.model.model.layers.{layer}.{_module(kind)}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).bfloat16()
    return tensors


def write_adapters(model_dir: Path, out: Path, indices: list[int], rank: int, targets: tuple[str, ...]) -> dict[int, Path]:
    """PEFT LoRA directories for `indices` under `out` (kept when already written); index -> directory."""
    layers, shapes = _projection_shapes(model_dir)
    unknown = set(targets) - set(shapes)
    if unknown:
        raise ValueError(f"--targets: {', '.join(sorted(unknown))} is not a projection; choose from {', '.join(shapes)}")
    sets: dict[int, dict[str, torch.Tensor]] = {}
    dirs = {}
    for index in indices:
        path = dirs[index] = out / adapter_name(index)
        if (path / "adapter_config.json").is_file():
            continue
        if index % TENSOR_SETS not in sets:
            sets[index % TENSOR_SETS] = _tensor_set(layers, shapes, targets, rank, seed=index % TENSOR_SETS)
        path.mkdir(parents=True, exist_ok=True)
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank * (1 + index / 1000),
                  "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False}
        save_file(sets[index % TENSOR_SETS], str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps(config))  # last: its presence marks a whole adapter
    return dirs


def zipf_requests(count: int, adapters: int, alpha: float, prompt_range: tuple[int, int], max_tokens: int,
                  vocab: int, seed: int) -> list[Request]:
    """`count` requests, each on adapter k (0-based) with probability proportional to 1/(k+1)^alpha."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, adapters + 1) ** alpha
    picks = rng.choice(adapters, size=count, p=weights / weights.sum())
    lengths = rng.integers(prompt_range[0], prompt_range[1] + 1, size=count)
    return [Request(int(k), rng.integers(3, vocab, size=int(n)).tolist(), max_tokens) for k, n in zip(picks, lengths)]
