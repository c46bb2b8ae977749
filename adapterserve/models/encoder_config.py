"""The encoder's shape and pooling, read from a Hugging Face checkpoint directory.

The shape comes from ``config.json`` through transformers. The pooling comes from
a sentence-transformers layout when there is one (``modules.json`` naming a
``Pooling`` module whose ``config.json`` picks mean or CLS pooling, and an optional
``Normalize`` module); without it the default is the BERT pooler when the
checkpoint has one, else the [CLS] token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig

SUPPORTED_MODEL_TYPES = ("bert", "roberta")
POOLING_MODES = ("mean", "cls", "pooler")  # pooler: tanh(dense(h[CLS])), BERT's own pooler

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"


@dataclass(frozen=True)
class PoolingConfig:
    """How a sentence vector is made from the last hidden states."""

    mode: str  # one of POOLING_MODES
    normalize: bool  # L2-normalise the pooled vector (sentence-transformers' Normalize)


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int
    position_offset: int | None  # RoBERTa: positions count non-pad tokens from pad_token_id + 1
    max_seq_length: int  # longest input the checkpoint was trained for (tokens, specials included)
    pooling: PoolingConfig

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def read_encoder_config(model_dir: str | Path, has_pooler: bool) -> EncoderConfig:
    """Parse a BERT-family checkpoint's config; ValueError for other families or options.

    ``has_pooler``: whether the checkpoint holds ``pooler.dense`` weights.
    """
    model_dir = Path(model_dir)
    hf = AutoConfig.from_pretrained(str(model_dir))
    _check_supported(hf)
    max_positions = hf.max_position_embeddings
    offset = hf.pad_token_id + 1 if hf.model_type == "roberta" else None
    usable = max_positions - (offset or 0)
    return EncoderConfig(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        layer_norm_eps=hf.layer_norm_eps,
        hidden_act=hf.hidden_act,
        max_position_embeddings=max_positions,
        type_vocab_size=hf.type_vocab_size,
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else 0,
        position_offset=offset,
        max_seq_length=min(usable, _st_max_seq_length(model_dir) or usable),
        pooling=read_pooling(model_dir, has_pooler),
    )


def _check_supported(hf) -> None:
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {hf.model_type!r} is not a supported encoder; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    kind = getattr(hf, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type={kind!r} is not supported; only absolute position embeddings are")
    if getattr(hf, "is_decoder", False) or getattr(hf, "add_cross_attention", False):
        raise ValueError("encoders configured as a decoder (is_decoder/add_cross_attention) are not supported")
    if hf.hidden_size % hf.num_attention_heads:
        raise ValueError(f"hidden_size {hf.hidden_size} is not a multiple of {hf.num_attention_heads} attention heads")
    if hf.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")


_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh")


def read_pooling(model_dir: Path, has_pooler: bool) -> PoolingConfig:
    """The sentence-transformers pooling of a checkpoint, or the BERT default."""
    modules = _st_modules(model_dir)
    if modules is None:
        return PoolingConfig(mode="pooler" if has_pooler else "cls", normalize=False)
    pooling = [m for m in modules if m.get("type") == _ST_POOLING]
    if len(pooling) != 1:
        raise ValueError(f"{model_dir / 'modules.json'} must name exactly one {_ST_POOLING} module")
    unknown = [m["type"] for m in modules if m.get("type") not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if unknown:
        raise ValueError(f"sentence-transformers module {unknown[0]} in {model_dir / 'modules.json'} is not supported")
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    return PoolingConfig(mode=_pooling_mode(model_dir / pooling[0].get("path", "")), normalize=normalize)


def _pooling_mode(pooling_dir: Path) -> str:
    config = json.loads((pooling_dir / "config.json").read_text())
    chosen = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    modes = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
    if len(chosen) != 1 or chosen[0] not in modes:
        raise ValueError(
            f"{pooling_dir / 'config.json'} selects pooling {chosen}; only one of mean tokens or CLS token is supported"
        )
    return modes[chosen[0]]


def _st_modules(model_dir: Path) -> list[dict] | None:
    file = model_dir / "modules.json"
    return json.loads(file.read_text()) if file.is_file() else None


def _st_max_seq_length(model_dir: Path) -> int | None:
    file = model_dir / "sentence_bert_config.json"
    return json.loads(file.read_text()).get("max_seq_length") if file.is_file() else None
