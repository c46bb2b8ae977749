"""Tiny checkpoints load with transformers offline and are fit to test against."""
from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from adapterserve.models.tiny import ARCHS, write_tiny_checkpoint

TEXT = "The lighthouse keeper baked bread at 6:30, naïve café 🙂 日本語\n  two  spaces."


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, model


def _stored_keys(path) -> set[str]:
    files = sorted(path.glob("*.safetensors"))
    keys = set()
    for file in files:
        with safe_open(file, "pt") as f:
            keys |= set(f.keys())
    return keys


def test_loads_with_all_weights_from_the_files(checkpoint):
    arch, path, model = checkpoint
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert _stored_keys(path) == expected
    with safe_open(path / "model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    for key, value in model.state_dict().items():
        if key in stored:
            assert torch.equal(value, stored[key]), key


def test_arch_features(checkpoint):
    arch, path, model = checkpoint
    cfg, layer = model.config, model.model.layers[0]
    if arch == "llama":
        rope = cfg.rope_parameters
        assert rope["rope_type"] == "llama3" and rope["factor"] > 1
        assert rope["original_max_position_embeddings"] < cfg.max_position_embeddings
        assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert not cfg.tie_word_embeddings
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    if arch == "qwen2":
        assert layer.self_attn.q_proj.bias is not None and layer.self_attn.q_proj.bias.abs().max() > 0
    if arch == "qwen3":
        assert not torch.all(layer.self_attn.q_norm.weight == 1)
        assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    assert not torch.all(layer.input_layernorm.weight == 1)  # norm weights are not the trivial ones


@torch.no_grad()
def test_logits_are_spread_and_greedy_decoding_varies(checkpoint):
    arch, path, model = checkpoint
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1.0, arch
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(set(out[0, 20:].tolist())) >= 6, arch


def test_tokenizer_round_trips(checkpoint):
    arch, path, model = checkpoint
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == model.config.vocab_size
    ids = tok(TEXT).input_ids
    assert max(ids) < model.config.vocab_size
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert tok.eos_token_id == model.config.eos_token_id
    assert len(ids) < len(TEXT.encode()) * 0.7  # merges were learned, not bytes only
    if arch in ("llama", "mistral"):
        assert ids[0] == tok.bos_token_id == model.config.bos_token_id
    else:
        assert tok.bos_token_id is None and tok.eos_token == "<|endoftext|>"


@torch.no_grad()
def test_sharded_checkpoint_loads_the_same_model(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "one", "qwen2", seed=4)
    sharded = write_tiny_checkpoint(tmp_path / "three", "qwen2", seed=4, shards=3)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(index["weight_map"]) == _stored_keys(single)
    ids = torch.tensor([[0, 5, 99, 300, 7]])
    a = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_seed_decides_the_weights(tmp_path):
    def weights(name, seed):
        path = write_tiny_checkpoint(tmp_path / name, "mistral", seed=seed)
        with safe_open(path / "model.safetensors", "pt") as f:
            return f.get_tensor("model.layers.0.self_attn.q_proj.weight")

    assert torch.equal(weights("a", 1), weights("b", 1))
    assert not torch.equal(weights("a2", 1), weights("c", 2))


def test_is_fast(tmp_path):
    write_tiny_checkpoint(tmp_path / "warm", "llama")
    start = time.perf_counter()
    write_tiny_checkpoint(tmp_path / "m", "qwen3", num_layers=4, shards=2)
    assert time.perf_counter() - start < 2.0


def test_vocab_larger_than_the_corpus_leaves_unused_rows(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "llama", vocab_size=2048)
    tok = AutoTokenizer.from_pretrained(path)
    assert 512 < len(tok) < 2048
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == model.model.embed_tokens.weight.shape[0] == 2048
    assert tok.decode(tok(TEXT).input_ids, skip_special_tokens=True) == TEXT


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        write_tiny_checkpoint(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="shards"):
        write_tiny_checkpoint(tmp_path / "y", "llama", shards=0)
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_checkpoint(tmp_path / "z", "qwen2", vocab_size=100)
