"""Classifier heads per slot on a decoder: label counts differ, batched with
generation, against PEFT sequence classification run alone (float32, CPU)."""
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model
from transformers import AutoModelForSequenceClassification

from adapterserve import Engine, SamplingParams
from adapterserve.errors import AdapterError, RequestError

TASKS = {  # name -> (labels, peft config)
    "sentiment": (["negative", "positive"], LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16,
                                                        target_modules=["q_proj", "v_proj"], init_lora_weights=False)),
    "topic": (["sports", "science", "arts", "news", "food"],
              PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)),
}


def _classifier(model_dir, labels):
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=len(labels), id2label=dict(enumerate(labels)), dtype=torch.float32)


@pytest.fixture(scope="module")
def heads(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for i, (name, (labels, config)) in enumerate(TASKS.items()):
        torch.manual_seed(i)
        model = get_peft_model(_classifier(llama_dir, labels), config)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "score" in pname or "prompt_encoder" in pname:
                    param.normal_(0, 0.3)
        model.save_pretrained(root / name)
        cfg_file = root / name / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["id2label"] = dict(enumerate(labels))
        cfg_file.write_text(json.dumps(cfg))
        out[name] = root / name
    return out


def test_classify_matches_peft_alone_and_mixes_with_generation(llama_dir, heads):
    engine = Engine.from_pretrained(llama_dir)
    for name, path in heads.items():
        engine.load_adapter(name, path)
    texts = ["The match went to extra time", "A new comet was seen", "Hikers follow the path", "The river runs"]
    ids = ["sentiment", "topic", "topic", "sentiment"]
    gen = engine.add_request("The river", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    results = engine.classify(texts, ids)
    tokenizer = engine.tokenizer
    for text, adapter, result in zip(texts, ids, results):
        labels, _ = TASKS[adapter]
        ref = PeftModel.from_pretrained(_classifier(llama_dir, labels), heads[adapter]).eval()
        with torch.no_grad():
            probs = ref(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        assert result.labels == labels
        assert len(result.probabilities) == len(labels)
        rel = (torch.tensor(result.probabilities) - probs).norm() / probs.norm()
        assert rel < 1e-4, (adapter, rel.item())
        assert result.label == labels[int(probs.argmax())]
    while engine.has_unfinished():
        engine.step()
    assert gen.finish_reason == "length" and len(gen.output_ids) == 5
    assert engine.blocks.num_free == engine.config.num_kv_blocks


def test_classify_needs_a_head(llama_dir, heads, tmp_path):
    from tests.helpers.lora import make_peft_lora

    engine = Engine.from_pretrained(llama_dir)
    engine.load_adapter("plain", make_peft_lora(llama_dir, tmp_path / "plain", r=4, lora_alpha=4, target_modules=["q_proj"]))
    with pytest.raises(RequestError, match="no classification head"):
        engine.classify(["hello"], ["plain"])
    with pytest.raises(RequestError, match="needs an adapter"):
        engine.classify(["hello"], [None])


def test_too_many_labels_is_refused(llama_dir, heads):
    engine = Engine.from_pretrained(llama_dir, max_labels=3)
    with pytest.raises(AdapterError, match="5 labels"):
        engine.load_adapter("topic", heads["topic"])
    engine.load_adapter("sentiment", heads["sentiment"])
    assert engine.list_adapters() == ["sentiment"]


def test_embed_returns_pooled_vectors(llama_dir, heads):
    engine = Engine.from_pretrained(llama_dir)
    engine.load_adapter("sentiment", heads["sentiment"])
    base, adapted = engine.embed(["The river runs", "The river runs"], [None, "sentiment"])
    assert len(base.embedding) == engine.model_config.hidden_size
    assert base.embedding != adapted.embedding


def test_async_classify_shares_the_loop_with_streams(llama_dir, heads):
    import asyncio

    engine = Engine.from_pretrained(llama_dir)
    engine.load_adapter("sentiment", heads["sentiment"])
    texts = ["The river runs", "A new comet was seen"]
    expected = engine.classify(texts, "sentiment")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = engine.generate(["Hikers follow"], params)[0].token_ids

    async def both():
        async def stream():
            return sum([c.token_ids async for c in engine.stream("Hikers follow", params)], [])
        return await asyncio.gather(stream(), engine.classify_async(texts, "sentiment"),
                                    engine.embed_async(texts, None))

    tokens, results, vectors = asyncio.run(both())
    assert tokens == alone
    for got, want in zip(results, expected):
        assert got.probabilities == pytest.approx(want.probabilities, rel=1e-5)
    assert len(vectors) == 2 and engine.blocks.num_free == engine.config.num_kv_blocks
