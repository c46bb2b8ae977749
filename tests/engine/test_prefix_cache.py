"""Prefix caching in the engine: a request starts after the cached blocks of its prefix
and gets exactly the tokens (and, within float32 rounding, the logits) it gets with
caching off; cached_tokens counts the hits exactly; blocks are reused only under the
same KV identity (adapter content) and cache salt (tenant); preemption, chunked
prefill and a small KV pool (eviction) keep every output unchanged.
(Every adapter family with caching on and off: test_prefix_families.py.)"""
import json
from pathlib import Path

import pytest
import torch

from adapterserve import Engine, SamplingParams
from tests.helpers.lora import make_peft_lora

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 4


def _ids(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, 500, (n,), generator=generator).tolist()


def _engine(llama_dir, caching: bool, **overrides) -> Engine:
    settings = {"block_size": BLOCK, "num_kv_blocks": 256, "enable_prefix_caching": caching} | overrides
    return Engine.from_pretrained(llama_dir, **settings)


def _first_logits(engine: Engine, prompt: list[int], adapter: str | None = None, salt: str = ""):
    """The logits of a request's first token (run alone), and the request, run to the end."""
    request = engine.add_request(prompt, GREEDY, adapter, cache_salt=salt)
    while request.num_outputs == 0:
        engine.step()
    logits = engine.runner.last_logits[0].float().clone()
    while engine.has_unfinished():
        engine.step()
    return logits, request


def _run(engine: Engine, prompts: list[list[int]], adapters=None, salts=None) -> list:
    """Add every prompt, then step until all are done; the requests."""
    adapters = adapters or [None] * len(prompts)
    salts = salts or [""] * len(prompts)
    requests = [engine.add_request(p, GREEDY, a, cache_salt=s) for p, a, s in zip(prompts, adapters, salts)]
    while engine.has_unfinished():
        engine.step()
    return requests


@pytest.fixture(scope="module")
def workload():
    """Prompts sharing a 23-token system prompt, with user turns of various lengths."""
    g = torch.Generator().manual_seed(11)
    system = _ids(23, g)
    return [system + _ids(n, g) for n in (1, 5, 9, 12, 16, 3)]


def test_cached_prompt_gives_the_same_tokens_and_logits(llama_dir, workload):
    off, on = _engine(llama_dir, False), _engine(llama_dir, True)
    prompt = workload[2]
    expected_logits, expected = _first_logits(off, prompt)
    _first_logits(on, workload[1])  # the system prompt's blocks are now cached
    logits, request = _first_logits(on, prompt)
    assert request.cached_tokens == 20  # 23 shared tokens: 5 full blocks
    assert request.output_ids == expected.output_ids
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    again_logits, again = _first_logits(on, prompt)  # whole prompt cached but its last token
    assert again.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK and again.output_ids == expected.output_ids
    torch.testing.assert_close(again_logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length,shared,cached", [
    (10, 10, 8),   # the same prompt: every full block before its last token
    (8, 8, 4),     # a whole number of blocks: the last block holds the last token, computed again
    (12, 7, 4),    # a prefix ending mid-block: only the full block before it
    (12, 3, 0),    # shorter than a block: nothing
    (1, 1, 0),
])
def test_cached_tokens_are_exact(llama_dir, length, shared, cached):
    g = torch.Generator().manual_seed(length * 31 + shared)
    first = _ids(max(length, shared), g)
    second = first[:shared] + [t + 1 for t in first[shared:length]]
    engine = _engine(llama_dir, True)
    assert _run(engine, [first[:length]])[0].cached_tokens == 0
    out = engine.generate([second], GREEDY)[0]
    assert out.cached_tokens == cached
    stats = engine.stats.snapshot()
    assert stats.prefix_queries == length + len(second) and stats.prefix_hits == cached


def test_caching_off_reports_nothing(llama_dir, workload):
    engine = _engine(llama_dir, False)
    outs = [engine.generate([workload[0]], GREEDY)[0] for _ in range(2)]
    assert [o.cached_tokens for o in outs] == [0, 0] and engine.blocks.num_cached == 0
    assert engine.stats.snapshot().prefix_queries == 0


def test_mixed_batch_with_chunked_prefill_matches_caching_off(llama_dir, workload):
    expected = [r.output_ids for r in _run(_engine(llama_dir, False), workload)]
    engine = _engine(llama_dir, True, max_num_batched_tokens=7)  # every prompt in chunks
    _run(engine, workload[:2])
    requests = _run(engine, workload)  # hits and misses, decodes and prefill chunks in each step
    assert [r.output_ids for r in requests] == expected
    assert [r.cached_tokens for r in requests][:2] == [20, 24] and all(r.cached_tokens >= 20 for r in requests)


def test_a_small_pool_evicts_and_preempts_yet_outputs_do_not_change(llama_dir, workload):
    g = torch.Generator().manual_seed(5)
    prompts = workload + [_ids(30, g) for _ in range(4)] + workload[::-1]
    expected = [r.output_ids for r in _run(_engine(llama_dir, False), prompts)]
    tight = _engine(llama_dir, True, num_kv_blocks=24, max_num_batched_tokens=16)
    requests = _run(tight, prompts)
    assert [r.output_ids for r in requests] == expected
    assert tight.scheduler.preemptions > 0  # the pool is too small for the batch
    assert tight.blocks.num_free == 24 and sum(r.cached_tokens for r in requests) > 0
    again = _run(tight, prompts)  # and again, with the cache full of the first run's blocks
    assert [r.output_ids for r in again] == expected and tight.blocks.num_free == 24


def test_multi_turn_chat_hits_the_previous_turns(llama_dir):
    g = torch.Generator().manual_seed(8)
    engine, conversation = _engine(llama_dir, True), _ids(13, g)
    off, previous = _engine(llama_dir, False), 0
    for turn in range(4):
        out = engine.generate([conversation], GREEDY)[0]
        assert out.token_ids == off.generate([conversation], GREEDY)[0].token_ids
        if turn:  # the previous prompt and its answer, but the last token, were computed before
            assert out.cached_tokens == (previous - 1) // BLOCK * BLOCK
        previous = len(conversation) + len(out.token_ids)
        conversation = conversation + out.token_ids + _ids(5, g)


def test_a_new_version_of_an_adapter_misses_and_equal_content_hits(llama_dir, tmp_path, workload):
    v1 = make_peft_lora(llama_dir, tmp_path / "v1", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1)
    v2 = make_peft_lora(llama_dir, tmp_path / "v2", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=2)
    engine, prompt = _engine(llama_dir, True), workload[3]
    engine.load_adapter("sql", v1)
    first = _run(engine, [prompt], ["sql"])[0]
    engine.unload_adapter("sql")
    engine.load_adapter("sql", v2)  # the same id, new weights
    second = _run(engine, [prompt], ["sql"])[0]
    assert second.cached_tokens == 0
    engine.load_adapter("sql-copy", v2)  # another id, the same content
    third = _run(engine, [prompt], ["sql-copy"])[0]
    assert third.cached_tokens > 0 and third.output_ids == second.output_ids != first.output_ids
    assert _run(engine, [prompt])[0].cached_tokens == 0  # the base model's KV is another


def test_salts_keep_tenants_apart(llama_dir, workload):
    engine, prompt = _engine(llama_dir, True), workload[4]
    _run(engine, [prompt], salts=["tenant:a"])
    other, same, unsalted = _run(engine, [prompt, prompt, prompt], salts=["tenant:b", "tenant:a", ""])
    assert other.cached_tokens == 0 and unsalted.cached_tokens == 0 and same.cached_tokens > 0


def test_an_adapter_after_the_last_layers_kv_shares_the_base_models_blocks(llama_dir, tmp_path, workload):
    """A LoRA only on the last layer's o_proj and MLP leaves every K/V as the base model's;
    one on an earlier layer's o_proj does not."""
    num_layers = json.loads((Path(llama_dir) / "config.json").read_text())["num_hidden_layers"]
    late = make_peft_lora(llama_dir, tmp_path / "late", r=4, lora_alpha=8, layers_to_transform=[num_layers - 1],
                          target_modules=["o_proj", "down_proj"], seed=3)
    early = make_peft_lora(llama_dir, tmp_path / "early", r=4, lora_alpha=8, layers_to_transform=[0],
                           target_modules=["o_proj"], seed=3)
    expected = {}
    for caching in (False, True):
        engine = _engine(llama_dir, caching)
        engine.load_adapter("late", late)
        engine.load_adapter("early", early)
        _run(engine, [workload[0]])  # base-model blocks of the system prompt
        expected[caching] = _run(engine, [workload[5], workload[5]], ["late", "early"])
    late_on, early_on = expected[True]
    assert late_on.cached_tokens == 20 and early_on.cached_tokens == 0
    assert [r.output_ids for r in expected[True]] == [r.output_ids for r in expected[False]]
    assert late_on.output_ids != _run(_engine(llama_dir, True), [workload[5]])[0].output_ids


def test_pooling_requests_reuse_blocks_too(llama_dir, workload):
    off, on = _engine(llama_dir, False), _engine(llama_dir, True)
    on.embed([workload[0]])
    [expected], [vector] = off.embed([workload[1]]), on.embed([workload[1]])
    torch.testing.assert_close(torch.tensor(vector.embedding), torch.tensor(expected.embedding), atol=1e-4, rtol=1e-4)
    assert on.stats.snapshot().prefix_hits == 20

