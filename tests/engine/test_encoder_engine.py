"""The encoder engine on the real all-MiniLM-L6-v2: one batch mixing Houlsby and
Pfeiffer adapters with heads (AdapterHub golden outputs), a PEFT LoRA + head
(PEFT run alone), and base rows; embeddings; refusals."""
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from adapterserve import Engine
from adapterserve.engine.encoder_engine import EncoderEngine
from adapterserve.errors import AdapterError, RequestError
from adapterserve.models.encoder_loader import default_encoder_dir

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adapterhub"
EXAMPLES = Path(__file__).parents[2] / "examples" / "adapters"


@pytest.fixture(scope="module")
def engine():
    engine = Engine.from_pretrained(default_encoder_dir(), max_loras=4)
    assert isinstance(engine, EncoderEngine)
    engine.load_adapter("houlsby", FIXTURES / "minilm-houlsby")
    engine.load_adapter("pfeiffer", FIXTURES / "minilm-pfeiffer")
    engine.load_adapter("sentiment", EXAMPLES / "sentiment-lora")
    return engine


def test_mixed_batch_matches_references(engine):
    sentences = json.loads((FIXTURES / "minilm_expected.json").read_text())["sentences"]
    golden = load_file(FIXTURES / "minilm_expected.safetensors")
    ids = ["houlsby", "pfeiffer", "sentiment"]
    texts = [s for s in sentences for _ in ids]
    results = engine.classify(texts, ids * len(sentences))
    ref = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(default_encoder_dir(), num_labels=2, dtype=torch.float32),
        EXAMPLES / "sentiment-lora").eval()
    for i, (text, adapter, result) in enumerate(zip(texts, ids * len(sentences), results)):
        row = i // len(ids)
        if adapter == "sentiment":
            with torch.no_grad():
                want = ref(**engine.tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        else:
            want = golden[f"{adapter}.logits"][row].softmax(-1)
        got = torch.tensor(result.probabilities)
        assert (got - want).norm() / want.norm() < 1e-4, (adapter, row)


def test_embeddings_with_and_without_adapters(engine):
    golden = load_file(FIXTURES / "minilm_expected.safetensors")
    sentences = json.loads((FIXTURES / "minilm_expected.json").read_text())["sentences"]
    outs = engine.embed(sentences + sentences, [None] * len(sentences) + ["houlsby"] * len(sentences))
    got = torch.tensor([o.embedding for o in outs])
    for name, part in (("base", got[: len(sentences)]), ("houlsby", got[len(sentences):])):
        want = _base_embeddings(engine, sentences) if name == "base" else golden[f"{name}.embedding"]
        assert (part - want).norm() / want.norm() < 1e-4, name
    assert (got[: len(sentences)] - got[len(sentences):]).norm() > 0.1


def _base_embeddings(engine, sentences):
    """sentence-transformers' recipe for all-MiniLM-L6-v2 on transformers' BertModel."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(default_encoder_dir(), dtype=torch.float32).eval()
    enc = engine.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_encoder_refusals(engine, tmp_path):
    with pytest.raises(RequestError, match="encoder"):
        engine.generate(["hello"])
    with pytest.raises(RequestError, match="needs an adapter"):
        engine.classify(["hello"], [None])
    with pytest.raises(AdapterError):
        engine.load_adapter("bad", FIXTURES / "llama-houlsby")
    assert "bad" not in engine.list_adapters()


def test_pinned_adapter_leaves_batches_to_the_other_slots(engine):
    tight = Engine.from_pretrained(default_encoder_dir(), max_loras=2)
    tight.load_adapter("houlsby", FIXTURES / "minilm-houlsby", pinned=True)
    tight.load_adapter("pfeiffer", FIXTURES / "minilm-pfeiffer")
    tight.load_adapter("sentiment", EXAMPLES / "sentiment-lora")
    texts = ["a fine film", "dull", "the cast is great"]
    ids = ["pfeiffer", "sentiment", "houlsby"] * len(texts)  # two unpinned adapters, one free slot
    rows = [t for t in texts for _ in range(3)]
    for got, want in zip(tight.classify(rows, ids), engine.classify(rows, ids)):
        assert got.label == want.label
        assert torch.allclose(torch.tensor(got.probabilities), torch.tensor(want.probabilities), atol=1e-5)
    assert tight.slots.is_resident("houlsby") and tight.slots.num_pinned == 1
