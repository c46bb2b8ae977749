"""Tiny random-weight Hugging Face checkpoints, written locally (no download).

Used by the demo (the embedded default backbone) and by tests. The directory is a
normal checkpoint: ``config.json``, safetensors weights (sharded with an index when
asked), ``generation_config.json`` and a byte-level BPE tokenizer trained here on a
small built-in corpus, so ``AutoModelForCausalLM`` and ``AutoTokenizer`` load it
offline.

Weights are drawn so that a wrong implementation shows: linear weights scale with
1/sqrt(fan_in) (attention is peaked, not uniform), norm weights and biases are not
their trivial 1/0, and the logits spread over several units. Embedding rows are
small next to the layers' outputs, so a tied head does not just echo the input
token and greedy decoding does not collapse at once.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"  # llama/mistral style
ENDOFTEXT = "<|endoftext|>"  # qwen style: EOS and pad, no BOS

_CORPUS = (
    "The lighthouse keeper climbed the stairs every evening at dusk. He counted the steps, "
    "one hundred and twelve of them, and wrote the weather in a small notebook: wind from "
    "the west, light rain, a ship far out that never came closer. In the morning he made "
    "tea, fed the cat, and listened to the radio tell him what he already knew.",
    "To make bread you need flour, water, salt and time. Mix the dough until it is smooth, "
    "let it rest for an hour, fold it twice, and bake it in a hot oven until the crust is "
    "dark and the loaf sounds hollow when you knock on it. Good bread is patient bread.",
    "A server that answers many questions at once must share its work fairly. Requests "
    "arrive, wait in a queue, run for a few steps, and leave when they are done. The "
    "scheduler decides who runs next; the cache keeps what was already computed; the "
    "model itself never changes, only the small adapters that steer it.",
    "Numbers like 3, 14, 159 and 2653 appear in tables, prices ($4.99, 12%) and dates such "
    "as 2024-05-17. Code looks different: def add(a, b): return a + b; for i in range(10): "
    "print(i * i). Questions end with marks? Exclamations too! Quotes \"like this\" and "
    "'like that' are common, and so are lists: apples, pears, plums; red, green, blue.",
    "In the mountains the river runs cold and clear over stones worn round by the water. "
    "Hikers follow the path along the bank, past the old mill and the wooden bridge, up to "
    "the lake where the fish rise at sunset and the only sound is the wind in the pines.",
    "Cette phrase est en français, und dieser Satz ist auf Deutsch. Ñandú, café, naïve, "
    "smörgåsbord, Ελληνικά, русский текст, 日本語の文章, "
    "and emoji such as 🙂 or 🚀 are bytes too.",
)


def write_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 160,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    shards: int = 1,
) -> Path:
    """Write a random-weight ``arch`` checkpoint with its tokenizer to ``path``.

    Defaults per arch: llama has Llama-3 rope scaling and tied embeddings (Llama-3.2
    style); mistral and qwen2 (q/k/v bias) are untied; qwen3 (q/k norm) uses a
    head_dim of 2 * hidden_size / heads, so its attention width differs from hidden.
    Tokenizers: llama/mistral put <|bos|> in front and end with <|eos|>; qwen adds no
    BOS and ends with <|endoftext|>, as the real ones do.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(arch, vocab_size)
    config = _config(
        arch,
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=_first_id(tokenizer.bos_token_id, tokenizer.eos_token_id),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **_arch_overrides(arch, hidden_size, num_attention_heads, head_dim, tie_word_embeddings),
    )
    model = _MODEL_CLASSES[arch](config)
    _randomize(model, seed)
    config.save_pretrained(out)
    _save_weights(model, out, shards)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _first_id(*ids: int | None) -> int | None:
    """Qwen configs name <|endoftext|> as BOS too, though their tokenizers add none."""
    return next((i for i in ids if i is not None), None)


_MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


_ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
_ROPE_DEFAULT = {"rope_type": "default", "rope_theta": 1e6}


def _arch_overrides(arch: str, hidden: int, heads: int, head_dim: int | None, tie: bool | None) -> dict:
    """Per-arch config fields: rope, tying, head_dim (qwen2 always uses hidden / heads)."""
    fields = {
        "rope_parameters": dict(_ROPE_LLAMA3 if arch == "llama" else _ROPE_DEFAULT),  # configs edit it
        "tie_word_embeddings": arch == "llama" if tie is None else tie,
    }
    if arch != "qwen2":
        fields["head_dim"] = head_dim or (2 if arch == "qwen3" else 1) * hidden // heads
    if arch == "mistral":
        fields["sliding_window"] = None
    return fields


def _config(arch: str, **kwargs) -> PretrainedConfig:
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    config = cls(rms_norm_eps=1e-5, **kwargs)
    config.dtype = torch.float32
    return config


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights that make logits spread and attention non-uniform."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name == "model.norm.weight":  # the final norm sets the logit scale
            param.copy_(3.0 * (1.0 + 0.1 * noise))
        elif name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.2 * noise)
        elif "embed_tokens" in name or "lm_head" in name:
            param.copy_(noise / math.sqrt(hidden))
        else:
            gain = 1.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
            param.copy_(noise * (gain / math.sqrt(param.shape[1])))


def _save_weights(model: torch.nn.Module, out: Path, shards: int) -> None:
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    names = list(state)
    if shards == 1:
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        return
    if shards > len(names):
        raise ValueError(f"shards={shards} exceeds the {len(names)} tensors of the checkpoint")
    weight_map = {}
    for i, group in enumerate(_split(names, state, shards), start=1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in group}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _split(names: list[str], state: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """Consecutive groups of roughly equal bytes, none empty."""
    sizes = [state[k].numel() * state[k].element_size() for k in names]
    target = sum(sizes) / shards
    groups: list[list[str]] = [[]]
    acc = 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        left_names, left_groups = len(names) - i, shards - len(groups)
        if groups[-1] and left_groups and (acc >= target * len(groups) or left_names <= left_groups):
            groups.append([])
        groups[-1].append(name)
        acc += size
    return groups


def _tokenizer(arch: str, vocab_size: int) -> PreTrainedTokenizerFast:
    style = "qwen" if arch.startswith("qwen") else "llama"
    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size, style))
    bos, eos, pad = (None, ENDOFTEXT, ENDOFTEXT) if style == "qwen" else (BOS, EOS, PAD)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, model_max_length=1024
    )


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int, style: str) -> str:
    """Byte-level BPE trained on the built-in corpus, up to ``vocab_size`` tokens.

    A larger vocab_size than the corpus supports leaves unused embedding rows, as
    real checkpoints often have.

    "llama": BOS/EOS/PAD specials and BOS put in front of every text. "qwen": no BOS,
    <|endoftext|> as EOS and pad (transformers loads Qwen2's own tokenizer class for
    qwen2, which adds <|endoftext|> when the vocabulary lacks it).
    """
    specials = [ENDOFTEXT, "<|im_start|>", "<|im_end|>"] if style == "qwen" else [BOS, EOS, PAD]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be at least {256 + len(specials)} (bytes and special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)  # the corpus gives at most ~860 tokens
    if style == "llama":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    return tok.to_str()
