"""The fp8 engine's CPU reference path, with adapters in the batch: the same tokens and
logits as a float32 engine on the quantized-then-dequantized checkpoint (so adapters are
applied to the activations exactly as on a float backbone), and logits near the
unquantized model's."""
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import record_logits
from tests.models.fp8_checkpoints import (
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
)

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# fp8 (e4m3, per-channel scales) against the unquantized float32 model, first-token logits:
# relative L2 error per prompt. e4m3 keeps 3 mantissa bits: each weight moves by up to 1/16 of
# itself, each projection's output by about 2.7% (RMS; test_fp8_kernels checks a layer). This
# tiny random model, built to have peaked attention, amplifies that over its layers, with a long
# tail: over 60,000 random prompts (this test's five a run, 12,000 runs) mean 0.10, 99.9th
# percentile about 0.35, max 0.50; the mean of a run's five at most 0.20. A wrong scale or
# layout gives errors near 1 on every prompt.
LOGIT_REL_TOL = 0.7  # each prompt
LOGIT_REL_MEAN_TOL = 0.3  # the mean of a run's prompts


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8engine")
    float_dir = write_tiny_checkpoint(root / "float", "llama", hidden_size=96, intermediate_size=224,
                                      num_attention_heads=6, num_key_value_heads=2, seed=7)
    dequantized = write_dequantized_checkpoint(write_fp8_checkpoint(float_dir, root / "fp8"), root / "dequantized")
    adapters = {
        "lora-r8": make_peft_lora(float_dir, root / "r8", r=8, lora_alpha=16, target_modules=ALL_LINEAR, seed=1),
        "lora-r4-attn": make_peft_lora(float_dir, root / "r4", r=4, lora_alpha=4,
                                       target_modules=["q_proj", "v_proj"], seed=2),
        "ia3": make_peft_adapter(float_dir, root / "ia3", family_configs()["ia3"], seed=3),
    }
    return float_dir, dequantized, adapters


def _engine(path, dtype, adapters):
    engine = Engine.from_pretrained(path, dtype=dtype, block_size=8, num_kv_blocks=128, max_loras=4)
    for name, adapter_dir in adapters.items():
        engine.load_adapter(name, adapter_dir)
    return engine


def _prompts(n):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for length in (2, 9, 17, 30, 5)[:n]]


def test_fp8_with_adapters_matches_float32_on_the_dequantized_weights(setup):
    float_dir, dequantized, adapters = setup
    fp8, ref = _engine(float_dir, "fp8", adapters), _engine(dequantized, "float32", adapters)
    prompts = _prompts(5)
    ids = [None, "lora-r8", "lora-r4-attn", "ia3", "lora-r8"]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got_logits, want_logits = record_logits(fp8), record_logits(ref)
    got = fp8.generate(prompts, greedy, adapter_ids=ids)
    want = ref.generate(prompts, greedy, adapter_ids=ids)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for ours, theirs in zip(got_logits[g.request_id], want_logits[w.request_id]):
            assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    base_only = ref.generate(prompts[1:2], greedy)[0].token_ids
    assert base_only != want[1].token_ids  # the adapter changed the tokens: the check has teeth


def test_fp8_logits_stay_near_the_unquantized_model(setup):
    float_dir, _, adapters = setup
    lora = {"lora-r8": adapters["lora-r8"]}
    fp8, full = _engine(float_dir, "fp8", lora), _engine(float_dir, "float32", lora)
    prompts = _prompts(5)
    ids = [None, "lora-r8", None, "lora-r8", None]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    got_logits, want_logits = record_logits(fp8), record_logits(full)
    got, want = fp8.generate(prompts, one, adapter_ids=ids), full.generate(prompts, one, adapter_ids=ids)
    rels = []
    for g, w in zip(got, want):
        ours, theirs = got_logits[g.request_id][0], want_logits[w.request_id][0]
        rels.append(((ours - theirs).norm() / theirs.norm()).item())
    assert all(0 < rel < LOGIT_REL_TOL for rel in rels), rels  # not zero: the weights really are quantized
    assert sum(rels) / len(rels) < LOGIT_REL_MEAN_TOL, rels
