"""Houlsby and Pfeiffer adapters on a Llama decoder, mixed with base rows and
LoRA in one batch, against the AdapterHub `adapters` library run alone (golden
fixtures written by scripts/golden/make_adapterhub_fixtures.py)."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from adapterserve import Engine, SamplingParams
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import record_logits

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adapterhub"


def _expected():
    meta = json.loads((FIXTURES / "llama_expected.json").read_text())
    return meta, load_file(FIXTURES / "llama_expected.safetensors")


def test_bottleneck_adapters_match_adapterhub_in_a_mixed_batch(tmp_path):
    meta, logits = _expected()
    engine = Engine.from_pretrained(FIXTURES / "tiny-llama", max_loras=4)
    engine.load_adapter("houlsby", FIXTURES / "llama-houlsby")
    engine.load_adapter("pfeiffer", FIXTURES / "llama-pfeiffer")
    engine.load_adapter("lora", make_peft_lora(FIXTURES / "tiny-llama", tmp_path / "lora", r=4, lora_alpha=8,
                                               target_modules=["q_proj", "down_proj"]))
    runs = ["base", "houlsby", "pfeiffer"]
    prompts = [p for _ in runs for p in meta["prompts"]]
    ids = [None if run == "base" else run for run in runs for _ in meta["prompts"]]
    prompts.append(meta["prompts"][0])
    ids.append("lora")
    captured = record_logits(engine)
    steps = meta["steps"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), adapter_ids=ids)
    for i, out in enumerate(outs[:-1]):
        name, p = runs[i // len(meta["prompts"])], i % len(meta["prompts"])
        assert out.token_ids == meta["tokens"][name][p], (name, p)
        got = torch.stack(captured[out.request_id])
        want = logits[f"{name}.logits.{p}"]
        rel = (got - want).norm() / want.norm()
        assert rel < 1e-4, (name, p, rel.item())
    assert outs[-1].token_ids != meta["tokens"]["base"][0]  # the LoRA row was really adapted
