"""PEFT LoRA adapters made by peft itself, and PEFT's own view of them (the oracle)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from adapterserve.adapters_store.formats.types import BackboneSpec

_LAYER_KIND = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def backbone_spec(model_dir: str | Path) -> BackboneSpec:
    """Linear shapes of a Llama-family checkpoint, read through transformers' config."""
    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_width, kv_width = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "q_proj": (h, q_width), "k_proj": (h, kv_width), "v_proj": (h, kv_width), "o_proj": (q_width, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }
    return BackboneSpec(cfg.model_type, cfg.num_hidden_layers, h, shapes)


def load_base(model_dir: str | Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_peft_lora(
    base_model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int,
    lora_alpha: float,
    target_modules: list[str] | str,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    strength: float = 0.5,
    **config_kwargs,
) -> Path:
    """Save a PEFT LoRA adapter of random non-zero weights, made and saved by peft.

    Weights are drawn so that ``scaling * B @ A`` has about ``strength`` times the
    standard deviation of the base weight it adapts: outputs move visibly, logits
    stay sane, whatever the rank and alpha.
    """
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        init_lora_weights=False,
        **config_kwargs,
    )
    model = get_peft_model(load_base(base_model_dir), config)
    _randomize_lora(model, seed, strength)
    model.save_pretrained(out_dir)  # safetensors by default
    return Path(out_dir)


@torch.no_grad()
def _randomize_lora(model: torch.nn.Module, seed: int, strength: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        rank, in_features = a.shape
        scaling = module.scaling["default"]
        a_std = 1.0 / math.sqrt(in_features)
        b_std = strength * module.get_base_layer().weight.std().item() / (scaling * math.sqrt(rank) * a_std)
        a.copy_(torch.randn(a.shape, generator=gen) * a_std)
        b.copy_(torch.randn(b.shape, generator=gen) * b_std)


def load_peft(base_model_dir: str | Path, adapter_dir: str | Path) -> PeftModel:
    return PeftModel.from_pretrained(load_base(base_model_dir), adapter_dir).eval()


@torch.no_grad()
def peft_deltas(peft_model: PeftModel) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, kind) -> delta_W [out, in] as PEFT computes it (``get_delta_weight``)."""
    deltas = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            layer, kind = _LAYER_KIND.search(name).groups()
            deltas[(int(layer), kind)] = module.get_delta_weight("default").float()
    return deltas
