"""Our BERT-family encoder against transformers' own implementation, float32 on CPU."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import (
    AutoModel,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    RobertaConfig,
    RobertaModel,
)

from adapterserve.layers.context import BatchContext, set_context
from adapterserve.models.encoder_config import PoolingConfig
from adapterserve.models.encoder_loader import default_encoder_dir, load_encoder

SENTENCES = [
    "A short one.",
    "This sentence is quite a bit longer than the first one, and it has commas, numbers like 42 and a question?",
    "Hi",
    "Encoders read the whole sentence at once.",
]


@pytest.fixture(autouse=True)
def no_adapters():
    set_context(BatchContext(attention=None, lora=None, lora_workspace=None, logits_rows=None))
    yield
    set_context(None)


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def minilm():
    path = default_encoder_dir()
    model, cfg = load_encoder(path)
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = AutoTokenizer.from_pretrained(str(path))(SENTENCES, padding=True, return_tensors="pt")
    return model, cfg, hf, tokens


def test_minilm_hidden_states_match_transformers(minilm):
    model, _, hf, tok = minilm
    with torch.no_grad():
        ours = model(tok["input_ids"], tok["attention_mask"])
        ref = hf(**tok).last_hidden_state
    real = tok["attention_mask"].bool()
    assert _rel(ours[real], ref[real]) < 1e-5
    for row in range(len(SENTENCES)):  # per sentence too, so one bad row cannot hide
        assert _rel(ours[row][real[row]], ref[row][real[row]]) < 1e-5


def test_minilm_pooling_is_sentence_transformers_mean_then_normalize(minilm):
    model, cfg, hf, tok = minilm
    assert cfg.pooling == PoolingConfig(mode="mean", normalize=True)
    assert cfg.max_seq_length == 256
    mask = tok["attention_mask"]
    with torch.no_grad():
        out = hf(**tok)
        ours = model.pool(model(tok["input_ids"], mask), mask)
    weights = mask.unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((out.last_hidden_state * weights).sum(1) / weights.sum(1), dim=1)
    assert _rel(ours, ref) < 1e-5
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-6)


def test_minilm_bert_pooler_and_cls(minilm):
    model, _, hf, tok = minilm
    mask = tok["attention_mask"]
    with torch.no_grad():
        out = hf(**tok)
        hidden = model(tok["input_ids"], mask)
    assert _rel(model.pool(hidden, mask, PoolingConfig("pooler", False)), out.pooler_output) < 1e-5
    assert _rel(model.pool(hidden, mask, PoolingConfig("cls", False)), out.last_hidden_state[:, 0]) < 1e-5


def test_row_is_independent_of_padding_and_batch(minilm):
    model, _, _, tok = minilm
    with torch.no_grad():
        batch = model(tok["input_ids"], tok["attention_mask"])
        n = int(tok["attention_mask"][2].sum())
        alone = model(tok["input_ids"][2:3, :n], tok["attention_mask"][2:3, :n])
    assert _rel(batch[2, :n], alone[0]) < 1e-5


def _random_checkpoint(path, arch: str) -> None:
    common = dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=64, layer_norm_eps=1e-5)
    torch.manual_seed(3)
    if arch == "bert":  # a masked-LM checkpoint: "bert." prefix, an MLM head to skip, no pooler
        model = BertForMaskedLM(BertConfig(**common, type_vocab_size=2, hidden_act="gelu_new"))
    else:  # RoBERTa: positions count from pad_token_id + 1, one token type, with a pooler
        model = RobertaModel(RobertaConfig(**common, type_vocab_size=1, pad_token_id=1, hidden_act="gelu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * (0.3 if param.dim() == 1 else param.shape[-1] ** -0.5))
    model.save_pretrained(path)


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_random_checkpoint_matches_transformers(tmp_path, arch):
    _random_checkpoint(tmp_path, arch)
    model, cfg = load_encoder(tmp_path)
    hf = AutoModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    pad = cfg.pad_token_id
    ids = torch.randint(3, cfg.vocab_size, (3, 17))
    mask = torch.ones_like(ids)
    for row, length in enumerate((17, 9, 2)):
        ids[row, length:], mask[row, length:] = pad, 0
    with torch.no_grad():
        ours = model(ids, mask)
        ref = hf(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    assert _rel(ours[real], ref.last_hidden_state[real]) < 1e-5
    if arch == "roberta":
        assert cfg.pooling == PoolingConfig("pooler", False)
        assert _rel(model.pool(ours, mask), ref.pooler_output) < 1e-5
    else:
        assert model.pooler is None and cfg.pooling == PoolingConfig("cls", False)


def test_refuses_unsupported_and_incomplete_checkpoints(tmp_path):
    _random_checkpoint(tmp_path / "ok", "roberta")
    relative = shutil.copytree(tmp_path / "ok", tmp_path / "relative")
    config = json.loads((relative / "config.json").read_text())
    (relative / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="position_embedding_type"):
        load_encoder(relative)
    pickled = shutil.copytree(tmp_path / "ok", tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        load_encoder(pickled)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "model.safetensors").write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="not a supported encoder"):
        load_encoder(llama)


def test_refuses_missing_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    _random_checkpoint(tmp_path, "roberta")
    state = load_file(tmp_path / "model.safetensors")
    state.pop(next(k for k in state if k.endswith("attention.self.key.weight")))
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights for: layers.0.qkv.weight"):
        load_encoder(tmp_path)
