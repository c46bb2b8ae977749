"""Load Hugging Face safetensors checkpoints (single file or sharded) into our models."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from adapterserve.models.decoder import DecoderModel
from adapterserve.models.decoder_config import DecoderConfig, read_decoder_config

_PREFIXES = ("model.", "")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint; pickled weights are never read."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(f"{model_dir} holds only pickled weights (*.bin/*.pt); convert them to safetensors")
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _target(model: DecoderModel, name: str) -> tuple[torch.Tensor, int] | None:
    """Our tensor for an HF weight name, and the row offset inside a fused weight."""
    cfg = model.cfg
    if name == "lm_head.weight":
        return (None if cfg.tie_word_embeddings else model.lm_head_weight, 0)
    for prefix in _PREFIXES:
        if name.startswith(prefix + "layers.") or name in (prefix + "embed_tokens.weight", prefix + "norm.weight"):
            name = name[len(prefix):]
            break
    if name == "embed_tokens.weight":
        return model.embed_tokens.weight, 0
    if name == "norm.weight":
        return model.norm.weight, 0
    parts = name.split(".")
    if parts[0] != "layers":
        return None
    layer = model.layers[int(parts[1])]
    module, param = ".".join(parts[2:-1]), parts[-1]
    fused = {
        "self_attn.q_proj": (layer.qkv_proj, 0),
        "self_attn.k_proj": (layer.qkv_proj, cfg.q_size),
        "self_attn.v_proj": (layer.qkv_proj, cfg.q_size + cfg.kv_size),
        "self_attn.o_proj": (layer.o_proj, 0),
        "mlp.gate_proj": (layer.gate_up_proj, 0),
        "mlp.up_proj": (layer.gate_up_proj, cfg.intermediate_size),
        "mlp.down_proj": (layer.down_proj, 0),
    }
    if module in fused:
        linear, offset = fused[module]
        return getattr(linear, param), offset
    plain = {
        "input_layernorm": layer.input_layernorm,
        "post_attention_layernorm": layer.post_attention_layernorm,
        "self_attn.q_norm": getattr(layer, "q_norm", None),
        "self_attn.k_norm": getattr(layer, "k_norm", None),
    }
    target = plain.get(module)
    return (target.weight, 0) if target is not None else None


def load_weights(model: DecoderModel, model_dir: Path) -> None:
    """Copy every checkpoint tensor into the model; error on missing or unknown ones."""
    loaded: dict[int, int] = {}  # id(param) -> rows written
    for name, tensor in iter_tensors(model_dir):
        found = _target(model, name)
        if found is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in a {model.cfg.model_type} decoder")
        dest, offset = found
        if dest is None:
            continue
        rows = dest[offset : offset + tensor.shape[0]]
        if rows.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
        rows.copy_(tensor)
        loaded[id(dest)] = loaded.get(id(dest), 0) + tensor.shape[0]
    missing = [n for n, p in model.named_parameters() if loaded.get(id(p), 0) != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights (or has duplicates) for: {', '.join(missing[:8])}")


def load_decoder(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, max_positions: int | None = None
) -> tuple[DecoderModel, DecoderConfig]:
    model_dir = Path(model_dir)
    cfg = read_decoder_config(model_dir)
    model = DecoderModel(cfg, max_positions or cfg.max_position_embeddings, dtype, device)
    with torch.no_grad():
        load_weights(model, model_dir)
    return model.eval(), cfg
