"""The issue's bar: ONE batch holding every family at once (LoRA, Houlsby, Pfeiffer,
prefix tuning, prompt tuning, P-tuning, (IA)^3, classifier heads and base rows),
each request matching its reference run alone: PEFT for PEFT families, the
`adapters` library (golden fixtures) for bottleneck adapters, transformers for base.
Run twice: with a step budget that holds every prompt, and with one of 3 tokens, so
that every prompt (virtual tokens, prefixes and heads included) runs in chunks over
several steps while other requests decode (chunked prefill)."""
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification

from adapterserve import Engine, SamplingParams
from tests.helpers.families import family_configs, greedy_by_forward, make_peft_adapter
from tests.helpers.lora import load_base, make_peft_lora

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adapterhub"
MODEL = FIXTURES / "tiny-llama"


def _head_adapter(out: Path) -> Path:
    torch.manual_seed(4)
    base = AutoModelForSequenceClassification.from_pretrained(MODEL, num_labels=3, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["v_proj"], init_lora_weights=False))
    with torch.no_grad():
        model.base_model.model.score.modules_to_save["default"].weight.normal_(0, 0.3)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("budget", [4096, 3], ids=["whole-prompts", "chunked-prefill"])
def test_one_batch_with_every_family(tmp_path, budget):
    meta = json.loads((FIXTURES / "llama_expected.json").read_text())
    steps = meta["steps"]
    peft_dirs = {name: make_peft_adapter(MODEL, tmp_path / name, cfg, seed=i)
                 for i, (name, cfg) in enumerate(family_configs().items())}
    peft_dirs["lora"] = make_peft_lora(MODEL, tmp_path / "lora", r=8, lora_alpha=16, target_modules="all-linear")
    engine = Engine.from_pretrained(MODEL, max_loras=16, block_size=4, max_num_batched_tokens=budget)
    for name, path in peft_dirs.items():
        engine.load_adapter(name, path)
    engine.load_adapter("houlsby", FIXTURES / "llama-houlsby")
    engine.load_adapter("pfeiffer", FIXTURES / "llama-pfeiffer")
    engine.load_adapter("head", _head_adapter(tmp_path / "head"))

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    prompt = meta["prompts"][1]
    generate = {name: engine.add_request(prompt, params, None if name == "base" else name)
                for name in ["base", "houlsby", "pfeiffer", *peft_dirs]}
    classify = engine.add_request(prompt, SamplingParams(max_tokens=1), "head", task="classify")
    first = engine.scheduler.schedule  # whole prompts: the first step must hold every request

    def check_first(*args):
        batch = first(*args)
        check_first.sizes.append(len(batch.requests))
        check_first.chunks.extend(n for n in batch.num_new_tokens if n > 1)
        return batch

    check_first.sizes, check_first.chunks = [], []
    engine.scheduler.schedule = check_first
    while engine.has_unfinished():
        engine.step()
    if budget > 100:
        assert check_first.sizes[0] == len(generate) + 1
    else:
        assert max(check_first.sizes) <= budget and max(check_first.chunks) <= budget

    for name in ("base", "houlsby", "pfeiffer"):
        assert generate[name].output_ids == meta["tokens"][name][1], name
    for name, path in peft_dirs.items():
        reference = PeftModel.from_pretrained(load_base(MODEL), path).eval()
        tokens, _ = greedy_by_forward(reference, prompt, steps, set())
        assert generate[name].output_ids == tokens, name
    head_ref = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(MODEL, num_labels=3, dtype=torch.float32),
        tmp_path / "head").eval()
    with torch.no_grad():
        probs = head_ref(input_ids=torch.tensor([prompt])).logits[0].softmax(-1)
    got = torch.tensor(classify.result.probabilities)
    assert (got - probs).norm() / probs.norm() < 1e-4
