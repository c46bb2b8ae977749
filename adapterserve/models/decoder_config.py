"""The decoder's shape, read from a Hugging Face config through transformers."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_parameters(hf) -> dict:
    """Rope settings as one dict with rope_type and rope_theta (transformers 4.x or 5.x)."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _sliding_windows(hf, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(hf, "sliding_window", None)
    if hf.model_type == "mistral":
        return (window,) * num_layers
    layer_types = getattr(hf, "layer_types", None)
    if not window or not layer_types or not getattr(hf, "use_sliding_window", False):
        return (None,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _eos_ids(hf) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def read_decoder_config(model_dir: str | Path) -> DecoderConfig:
    """Parse config.json of a Llama-family checkpoint; ValueError for other families."""
    hf = AutoConfig.from_pretrained(str(model_dir))
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {hf.model_type!r} is not a supported decoder; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    return DecoderConfig(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope=_rope_parameters(hf),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        o_bias=hf.model_type != "qwen2" and bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=hf.model_type == "qwen3",
        sliding_windows=_sliding_windows(hf, hf.num_hidden_layers),
        eos_token_ids=_eos_ids(hf),
    )
