"""n > 1: one request, n choices. The prompt is computed once; the choices share its KV
blocks (the block holding its last token copied for each), sample on their own (choice i
with seed + i) and end on their own. Every choice equals a separate request run alone
(greedy: the request with n = 1; seeded: the request with the choice's seed)."""
import asyncio

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.errors import RequestError
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora

BLOCK = 4


def _engine(llama_dir, **overrides) -> Engine:
    return Engine.from_pretrained(llama_dir, **({"block_size": BLOCK, "num_kv_blocks": 64} | overrides))


def _prompt(length: int, seed: int = 3) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sampled(n: int = 1, seed: int | None = 7, **fields) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "seed": seed, "n": n} | fields))


def _alone(engine: Engine, prompt: list[int], params: list[SamplingParams]):
    """Each sampling run as its own request, one at a time."""
    return [engine.generate([prompt], p)[0] for p in params]


@pytest.mark.parametrize("caching", [False, True])
def test_greedy_choices_are_identical_and_equal_one_request(llama_dir, caching):
    engine = _engine(llama_dir, enable_prefix_caching=caching)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    single = engine.generate([_prompt(10)], greedy)[0]
    outs = engine.generate([_prompt(10)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3))
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.token_ids for o in outs] == [single.token_ids] * 3
    assert {o.finish_reason for o in outs} == {"length"} and {o.request_id for o in outs} == {outs[0].request_id}
    assert engine.blocks.num_free == 64


@pytest.mark.parametrize("length", [10, 8, 1])  # the last block partial, full, the prompt one token
def test_seeded_choices_equal_requests_with_the_derived_seeds(llama_dir, length):
    engine = _engine(llama_dir)
    outs = engine.generate([_prompt(length)], _sampled(n=3))
    alone = _alone(engine, _prompt(length), [_sampled(seed=7 + i) for i in range(3)])
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outs}) == 3  # they diverge at once, inside the copied block


def test_choice_seeds_wrap_like_a_generator_does():
    assert [SamplingParams(seed=2**64 - 2, n=3).choice_seed(i) for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert SamplingParams(seed=-1, n=2).choice_seed(1) == 0 and SamplingParams(n=2).choice_seed(1) is None


def test_choices_write_their_own_copies_of_the_prompts_last_block(llama_dir):
    """Copy on write: the choices diverge inside the prompt's partial last block. Run them
    beside other requests, then again with the copies undone: without its own copy each
    choice reads the others' keys and values, and the tokens change."""
    engine = _engine(llama_dir)
    params = [_sampled(seed=7 + i) for i in range(4)]
    expected = [a.token_ids for a in _alone(engine, _prompt(10), params)]
    request = engine.add_request(_prompt(10), _sampled(n=4))
    others = [engine.add_request(_prompt(6, seed=s), _sampled(seed=s)) for s in (1, 2)]
    while engine.has_unfinished():
        engine.step()
        shared = [c.blocks[:2] for c in request.all_choices if len(c.blocks) >= 2 and not c.finished]
        if len(shared) == 4:  # all four forked: the prompt's two full blocks held by each
            assert all(s == shared[0] for s in shared)
            assert all(engine.blocks.holders(b) == 4 for b in shared[0])
            assert len({c.blocks[2] for c in request.all_choices}) == 4  # the copies
    assert [c.output_ids for c in request.all_choices] == expected
    assert all(o.finished for o in others) and engine.blocks.num_free == 64


def test_without_the_copy_the_choices_corrupt_each_other(llama_dir, monkeypatch):
    """The test above can fail: the same choices with each copy left empty (not copied) differ."""
    engine = _engine(llama_dir)
    expected = [a.token_ids for a in _alone(engine, _prompt(10), [_sampled(seed=7 + i) for i in range(4)])]
    monkeypatch.setattr(engine.runner, "copy_blocks", lambda sources, copies: None)
    outs = engine.generate([_prompt(10)], _sampled(n=4))
    assert [o.token_ids for o in outs] != expected


def test_n_choices_hold_fewer_blocks_than_n_requests(llama_dir):
    """Prompt 10 tokens, 6 more each (block 4): 4 requests hold 4 blocks each; 4 choices share
    the prompt's 2 full blocks and hold 2 of their own each."""
    def peak(add) -> int:
        engine = _engine(llama_dir, enable_prefix_caching=False)  # separate requests share nothing
        add(engine)
        most = 0
        while engine.has_unfinished():
            engine.step()
            most = max(most, engine.blocks.num_blocks - engine.blocks.num_free)
        return most

    params = _sampled(max_tokens=6)
    together = peak(lambda e: e.add_request(_prompt(10), _sampled(n=4, max_tokens=6)))
    apart = peak(lambda e: [e.add_request(_prompt(10), params) for _ in range(4)])
    assert (together, apart) == (2 + 4 * 2, 4 * 4)


def test_each_choice_stops_on_its_own(llama_dir):
    engine = _engine(llama_dir)
    free = _alone(engine, _prompt(10), [_sampled(seed=7 + i) for i in range(3)])
    stop = free[1].token_ids[3]  # choice 1 meets it by its 4th token
    params = [_sampled(seed=7 + i, stop_token_ids=[stop]) for i in range(3)]
    alone = _alone(engine, _prompt(10), params)
    outs = engine.generate([_prompt(10)], _sampled(n=3, stop_token_ids=[stop]))
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(a.token_ids, a.finish_reason) for a in alone]
    assert outs[1].finish_reason == "stop" and "length" in {o.finish_reason for o in outs}


def test_choices_count_against_max_num_seqs(llama_dir):
    engine = _engine(llama_dir, max_num_seqs=4)
    requests = [engine.add_request(_prompt(10, seed=s), _sampled(n=3, seed=s)) for s in (3, 4)]
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 4  # the second waits for room for its three
    for request, s in zip(requests, (3, 4)):
        alone = _alone(engine, _prompt(10, seed=s), [_sampled(seed=s + i) for i in range(3)])
        assert [c.output_ids for c in request.all_choices] == [a.token_ids for a in alone]


def test_more_choices_than_max_num_seqs_or_on_a_pooling_task_are_refused(llama_dir):
    engine = _engine(llama_dir, max_num_seqs=4)
    with pytest.raises(RequestError, match=r"'n' is 5, but this engine runs at most 4 sequences"):
        engine.add_request(_prompt(5), _sampled(n=5))
    with pytest.raises(RequestError, match="'n' must be 1 for embed"):
        engine.add_request(_prompt(5), _sampled(n=2), task="embed")
    assert not engine.requests and not engine.has_unfinished()


@pytest.mark.parametrize("n", [0, -1, 129, 2.0, "2", True, None])
def test_bad_n_is_refused_by_name(n):
    with pytest.raises(RequestError, match="'n' must be"):
        SamplingParams(n=n)


def test_abort_ends_every_choice_and_frees_every_block(llama_dir):
    engine = _engine(llama_dir)
    request = engine.add_request(_prompt(10), _sampled(n=3, max_tokens=30))
    while not all(c.output_ids for c in request.all_choices):
        engine.step()
    assert engine.abort(request.request_id)
    assert [c.finish_reason for c in request.all_choices] == ["abort"] * 3
    assert not engine.abort(request.request_id) and not engine.requests
    while engine.has_unfinished() or engine._in_flight is not None:
        engine.step()
    assert engine.blocks.num_free == 64


def test_abort_after_the_first_choice_finished_ends_the_rest(llama_dir):
    engine = _engine(llama_dir)
    request = engine.add_request(_prompt(10), _sampled(n=2, max_tokens=30))
    while not request.output_ids:
        engine.step()
    engine.scheduler.finish(request, "stop")  # choice 0 ends first
    assert request.request_id in engine.requests  # its other choice still runs
    assert engine.abort(request.request_id)
    assert [c.finish_reason for c in request.all_choices] == ["stop", "abort"] and not engine.requests


def test_an_error_in_one_choice_ends_every_choice(llama_dir):
    engine = _engine(llama_dir)
    request = engine.add_request(_prompt(10), _sampled(n=3, max_tokens=30))
    while not all(c.output_ids for c in request.all_choices):
        engine.step()
    failure = RuntimeError("choice 1 failed")
    final = engine._fail(request.all_choices[1], failure)
    assert final.error is failure and final.index == 1
    assert [(c.finish_reason, c.error) for c in request.all_choices] == [("error", failure)] * 3
    assert not engine.requests and not engine.has_unfinished()


def test_closing_the_stream_early_aborts_every_choice(llama_dir):
    engine = _engine(llama_dir)

    async def first_chunk():
        stream = engine.stream(_prompt(10), _sampled(n=3, max_tokens=30))
        chunk = await anext(stream)
        await stream.aclose()
        return chunk

    assert asyncio.run(first_chunk()).token_ids
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    while engine._in_flight is not None:
        engine.step()
    assert engine.blocks.num_free == 64


def test_preempted_choices_still_equal_requests_alone(llama_dir):
    tight = _engine(llama_dir, num_kv_blocks=12)
    roomy = _engine(llama_dir)
    params = _sampled(n=3, max_tokens=20)
    outs = tight.generate([_prompt(10)], params)
    assert tight.scheduler.preemptions > 0  # 3 x 30 tokens do not fit 12 blocks of 4 at once
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate([_prompt(10)], params)]
    assert tight.blocks.num_free == 12


@pytest.mark.parametrize("caching", [False, True])
def test_a_choice_without_a_free_block_at_the_fork_runs_on_its_own(llama_dir, caching):
    """3 blocks of 4: the prompt takes 2, one choice forks into the last free one; the third
    waits, and runs as a request of its own once blocks are free."""
    tight = _engine(llama_dir, num_kv_blocks=3, enable_prefix_caching=caching)
    request = tight.add_request(_prompt(6), _sampled(n=3, max_tokens=2))
    tight.step()
    assert [len(c.blocks) for c in request.all_choices] == [2, 2, 0] and tight.blocks.num_free == 0
    assert request.all_choices[2] in tight.scheduler.waiting
    while tight.has_unfinished():
        tight.step()
    alone = _alone(_engine(llama_dir), _prompt(6), [_sampled(seed=7 + i, max_tokens=2) for i in range(3)])
    assert [c.output_ids for c in request.all_choices] == [a.token_ids for a in alone]
    assert tight.blocks.num_free == 3


def test_a_cached_prompt_forks_too(llama_dir):
    engine = _engine(llama_dir, enable_prefix_caching=True)
    engine.generate([_prompt(10)], _sampled())
    outs = engine.generate([_prompt(10)], _sampled(n=3))
    alone = _alone(_engine(llama_dir), _prompt(10), [_sampled(seed=7 + i) for i in range(3)])
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert [o.cached_tokens for o in outs] == [8, 8, 8]


def test_stream_yields_every_choice_by_index_and_ends_after_the_last(llama_dir):
    engine = _engine(llama_dir)
    alone = _alone(engine, _prompt(10), [_sampled(seed=7 + i) for i in range(3)])

    async def collect():
        chunks = []
        async for chunk in engine.stream(_prompt(10), _sampled(n=3, max_tokens=8)):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(collect())
    tokens = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)}
    ends = [c for c in chunks if c.finished]
    assert sorted(c.index for c in ends) == [0, 1, 2] and chunks[-1].finished
    assert [tokens[i] for i in range(3)] == [a.token_ids for a in alone]
    assert not engine.requests and engine.blocks.num_free == 64


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """A LoRA on k/v, a prompt-tuning adapter (virtual tokens) and a prefix-tuning adapter."""
    root, configs = tmp_path_factory.mktemp("n-adapters"), family_configs()
    return {"lora": make_peft_lora(llama_dir, root / "lora", r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                                   seed=1),
            "prompt": make_peft_adapter(llama_dir, root / "prompt", configs["prompt"], seed=2),
            "prefix": make_peft_adapter(llama_dir, root / "prefix", configs["prefix"], seed=3)}


@pytest.mark.parametrize("family", ["lora", "prompt", "prefix"])
def test_choices_under_an_adapter_equal_requests_alone(llama_dir, adapters, family):
    engine = _engine(llama_dir, max_loras=2)
    engine.load_adapter(family, adapters[family])
    alone = [engine.generate([_prompt(10)], _sampled(seed=7 + i), adapter_ids=[family])[0].token_ids
             for i in range(3)]
    outs = engine.generate([_prompt(10), _prompt(6, seed=9)], [_sampled(n=3), _sampled(seed=1)],
                           adapter_ids=[family, None])
    assert [o.token_ids for o in outs[:3]] == alone
    assert engine.slots.refs == [0, 0]  # every choice gave its hold on the slot back


def test_choices_under_tensor_parallelism_equal_one_rank():
    """TP=2 (CPU, gloo; rank 1 a local process): the fork's block copies reach every rank."""
    from tests.engine.test_tp_engine import MODEL

    settings = dict(block_size=4, num_kv_blocks=64, tensor_parallel_launch="local")
    outputs = []
    for size in (1, 2):
        engine = Engine.from_pretrained(MODEL, tensor_parallel_size=size, **settings)
        try:
            outputs.append([o.token_ids for o in engine.generate([_prompt(10)], _sampled(n=3))])
        finally:
            engine.close()
    assert outputs[0] == outputs[1] and len({tuple(t) for t in outputs[0]}) == 3
