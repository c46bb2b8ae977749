"""Chunked prefill: prompts longer than a step's token budget run in chunks, decodes first;
every request that fits max_model_len completes whatever the budget, with the tokens it
has when its prompt runs whole. (Every family under chunking: test_all_families.py.)"""
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.errors import RequestError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _recording(engine: Engine) -> list[list[int]]:
    """Wrap the scheduler so each step's token counts are kept."""
    steps: list[list[int]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        batch = schedule()
        steps.append(list(batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = recorded
    return steps


@pytest.fixture
def roomy(llama_dir):
    return Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=256)


def test_prompt_far_over_the_budget_completes_with_the_same_tokens(llama_dir, roomy):
    prompt = _prompts([200], seed=1)[0]
    expected = roomy.generate([prompt], GREEDY)[0].token_ids
    tight = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    steps = _recording(tight)
    out = tight.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected and out.finish_reason == "length"
    assert max(sum(s) for s in steps) <= 16
    assert sum(1 for s in steps if s and s[0] > 1) == -(-200 // 16)  # 13 chunks, then decodes


def test_decodes_run_first_and_a_long_prompt_does_not_stall_them(llama_dir, roomy):
    short, long = _prompts([5, 5, 300], seed=2)[:2], _prompts([300], seed=3)[0]
    expected = [o.token_ids for o in roomy.generate(short + [long], GREEDY)]
    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=256, max_num_batched_tokens=24)
    steps = _recording(engine)
    running = [engine.add_request(p, GREEDY) for p in short]
    engine.step()
    late = engine.add_request(long, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in running + [late]] == expected
    # while the long prompt ran in chunks, both short requests decoded every step
    chunked = [s for s in steps[1:] if any(n > 1 for n in s)]
    assert len(chunked) >= 300 // 24 and all(s[:2] == [1, 1] for s in chunked[:8])


def test_preempted_requests_resume_in_chunks(llama_dir, roomy):
    prompts = _prompts([20, 18, 22, 16], seed=4)  # they start together, then outgrow the cache
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=40, max_num_batched_tokens=12)
    preemptions = []
    preempt = tight.scheduler._preempt

    def counted(request):
        preemptions.append(request.num_tokens)
        preempt(request)

    tight.scheduler._preempt = counted
    steps = _recording(tight)
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert max(preemptions) > 12  # recomputed in more than one chunk
    assert max(sum(s) for s in steps) <= 12 and tight.blocks.num_free == 40


def test_prompt_plus_max_tokens_over_max_model_len_is_refused_naming_both(llama_dir):
    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=64, max_model_len=64)
    prompt = _prompts([50], seed=5)[0]
    with pytest.raises(RequestError, match="prompt has 50 tokens and max_tokens is 15: 65 is over .* 64"):
        engine.add_request(prompt, SamplingParams(max_tokens=15))
    out = engine.generate([prompt], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    assert not engine.has_unfinished()


def test_pooling_requests_pool_after_their_last_chunk(llama_dir):
    texts = _prompts([70, 9], seed=6)
    whole = Engine.from_pretrained(llama_dir, block_size=4).embed(texts)
    chunked = Engine.from_pretrained(llama_dir, block_size=4, max_num_batched_tokens=8).embed(texts)
    for a, b in zip(whole, chunked):
        assert torch.allclose(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-5)
