"""PEFT adapters of the non-LoRA families, made and saved by peft, and a greedy
reference decoder that runs PEFT's own forward (PeftModel.generate ignores
prefix-tuning prefixes with recent transformers; its forward applies them)."""
from __future__ import annotations

from pathlib import Path

import torch
from peft import (
    IA3Config,
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptTuningConfig,
    get_peft_model,
)

from tests.helpers.lora import load_base, make_peft_lora

ADAPTERHUB = Path(__file__).parents[1] / "fixtures" / "adapterhub"


def make_peft_adapter(base_model_dir: str | Path, out_dir: str | Path, config, *, seed: int = 0) -> Path:
    """Save a peft adapter of ``config`` with random trained-looking weights."""
    base = load_base(base_model_dir)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    embed_std = base.get_input_embeddings().weight.std().item()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ia3_l" in name:
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen))
            elif "prompt_encoder" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * (3 * embed_std if param.dim() > 1 else 0.1))
    model.save_pretrained(out_dir)
    return Path(out_dir)


def family_configs() -> dict[str, object]:
    return {
        "ia3": IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                         feedforward_modules=["down_proj"]),
        "ia3-attn": IA3Config(task_type="CAUSAL_LM", target_modules=["q_proj", "o_proj"], feedforward_modules=["o_proj"]),
        "prompt": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
        "p-tuning": PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=32),
        "prefix": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6),
        "prefix-long": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=11),
    }


def every_family(model_dir: Path, root: Path) -> dict[str, Path]:
    """Name -> directory: PEFT LoRA (all linear layers), (IA)^3, prefix and prompt tuning
    written for the tiny Llama at model_dir under root, beside its AdapterHub Houlsby and
    Pfeiffer fixtures."""
    configs = family_configs()
    out = {"lora": make_peft_lora(model_dir, root / "lora", r=8, lora_alpha=16, target_modules="all-linear", seed=2),
           "houlsby": ADAPTERHUB / "llama-houlsby", "pfeiffer": ADAPTERHUB / "llama-pfeiffer"}
    for i, name in enumerate(("ia3", "prefix", "prompt")):
        out[name] = make_peft_adapter(model_dir, root / name, configs[name], seed=10 + i)
    return out


@torch.no_grad()
def greedy_by_forward(model, prompt: list[int], max_tokens: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of the last one, recomputing the forward each step."""
    ids, logits = list(prompt), None
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        ids.append(token)
        if token in eos:
            break
    return ids[len(prompt):], logits
