"""Prefix caching under every family at once (LoRA, Houlsby, Pfeiffer, prefix tuning,
prompt tuning, P-tuning, (IA)^3, a classifier head, and base rows): one mixed batch whose
requests hit the blocks their own adapter computed the round before gives exactly the
tokens (and head probabilities) of an engine with caching off; whole prompts, and
chunked prefill with a budget of 5 tokens."""
from pathlib import Path

import pytest
import torch

from adapterserve import Engine, SamplingParams
from tests.engine.test_all_families import _head_adapter
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adapterhub"
MODEL = FIXTURES / "tiny-llama"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {name: make_peft_adapter(MODEL, root / name, cfg, seed=i) for i, (name, cfg) in enumerate(family_configs().items())}
    dirs["lora"] = make_peft_lora(MODEL, root / "lora", r=8, lora_alpha=16, target_modules="all-linear")
    dirs["houlsby"], dirs["pfeiffer"] = FIXTURES / "llama-houlsby", FIXTURES / "llama-pfeiffer"
    dirs["head"] = _head_adapter(root / "head")
    return dirs


def _round(engine: Engine, prompts: dict[str | None, list[int]], classify: list[int]):
    """One mixed batch: a generation per adapter (None: the base model) and a classification."""
    generate = {name: engine.add_request(p, GREEDY, name) for name, p in prompts.items()}
    head = engine.add_request(classify, SamplingParams(max_tokens=1), "head", task="classify")
    while engine.has_unfinished():
        engine.step()
    return generate, head


@pytest.mark.parametrize("budget", [4096, 5], ids=["whole-prompts", "chunked-prefill"])
def test_every_family_hits_its_own_blocks_and_matches_caching_off(adapter_dirs, budget):
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, 500, (22,), generator=g).tolist()
    names = [None, *(n for n in adapter_dirs if n != "head")]
    turns = [{n: system + torch.randint(3, 500, (k % 5 + 1,), generator=g).tolist() for k, n in enumerate(names)}
             for _ in range(2)]
    results = {}
    for caching in (False, True):
        engine = Engine.from_pretrained(MODEL, max_loras=16, block_size=4, max_num_batched_tokens=budget,
                                        enable_prefix_caching=caching)
        for name, path in adapter_dirs.items():
            engine.load_adapter(name, path)
        results[caching] = [_round(engine, turn, turn[None]) for turn in turns]
    for (off, off_head), (on, on_head) in zip(results[False], results[True]):
        assert {n: r.output_ids for n, r in on.items()} == {n: r.output_ids for n, r in off.items()}
        torch.testing.assert_close(torch.tensor(on_head.result.probabilities),
                                   torch.tensor(off_head.result.probabilities), atol=1e-5, rtol=1e-4)
    second, head = results[True][1]
    missed = [n for n, r in second.items() if not r.cached_tokens]
    assert not missed, f"no prefix-cache hit for {missed}"
    assert head.cached_tokens == 20  # its own (LoRA on v_proj) system-prompt blocks of the round before
