"""Continuous batching: requests joining mid-flight, abort, preemption, seeds, stops."""
import asyncio

import numpy as np
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.engine.request import RequestTimes
from adapterserve.errors import RequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _random_prompts(n: int, vocab: int = 512) -> list[list[int]]:
    return [torch.randint(3, vocab, (int(torch.randint(2, 30, ())),)).tolist() for _ in range(n)]


@pytest.fixture
def engine(llama_dir):
    return Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=128)


def _alone(engine, prompt, params=GREEDY):
    return engine.generate([prompt], params)[0].token_ids


def test_requests_added_mid_generation_match_running_alone(engine):
    prompts = _random_prompts(4)
    expected = [_alone(engine, p) for p in prompts]
    first = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    for _ in range(5):
        engine.step()
    late = [engine.add_request(p, GREEDY) for p in prompts[2:]]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in first + late] == expected


def test_abort_frees_kv_blocks_at_once(engine):
    free = engine.blocks.num_free
    request = engine.add_request(_random_prompts(1)[0], SamplingParams(max_tokens=50, temperature=0.0))
    other = engine.add_request(_random_prompts(1)[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.blocks.num_free < free
    assert engine.abort(request.request_id)
    assert request.finish_reason == "abort" and not request.blocks
    while engine.has_unfinished():
        engine.step()
    assert other.finish_reason == "length"
    assert engine.blocks.num_free == free
    assert not engine.abort(request.request_id)


def test_seeded_sampling_is_independent_of_batch_composition(engine):
    prompt = _random_prompts(1)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0].token_ids
    others = _random_prompts(5)
    noisy = SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True)
    outs = engine.generate(others[:3] + [prompt] + others[3:], [noisy] * 3 + [seeded] + [noisy] * 2)
    assert outs[3].token_ids == alone
    unseeded = engine.generate([prompt] * 4, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in unseeded}) > 1  # sampling really samples


def test_preemption_when_kv_cache_runs_out_keeps_outputs(llama_dir):
    prompts = _random_prompts(6)
    roomy = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=256)
    tight = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=40)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.blocks.num_free == 40


def test_stop_token_ids_and_max_tokens(engine):
    prompt = _random_prompts(1)[0]
    tokens = _alone(engine, prompt)
    stop_at = tokens[4]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == tokens[: tokens.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    assert engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0].finish_reason in ("length", "stop")


def test_stop_string_cuts_text(engine):
    prompt = "The river runs"
    full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


HIKERS = "Hikers follow the path"
TEN_TOKENS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _assert_adds_up(chunks: list, expected) -> None:
    """A stream's chunks give the whole output's ids and text, and end it by its length."""
    assert sum((c.token_ids for c in chunks), []) == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text and chunks[-1].finish_reason == "length"


def test_stream_yields_deltas_that_add_up(engine):
    prompt, params = HIKERS, TEN_TOKENS
    expected = engine.generate([prompt], params)[0]

    async def collect():
        chunks = [c async for c in engine.stream(prompt, params)]
        return chunks

    chunks = asyncio.run(collect())
    _assert_adds_up(chunks, expected)
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_closing_a_stream_aborts_and_frees_blocks(engine):
    free = engine.blocks.num_free

    async def read_two():
        stream = engine.stream("The river", SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return got

    assert len(asyncio.run(read_two())) == 2
    assert engine.blocks.num_free == free and not engine.has_unfinished()


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1, 99999], SamplingParams(), "token ids"),
        ([1, -1], SamplingParams(), r"token ids must be in \[0, 512\)"),
        ([5] * 300 + [512], SamplingParams(), r"token ids must be in \[0, 512\)"),
        ([1, True], SamplingParams(), "token ids must be integers"),
        ([1, 2.0], SamplingParams(), "token ids must be integers"),
        ([1] * 5000, SamplingParams(), "5000 tokens and max_tokens is 16: 5016 is over"),
    ],
)
def test_bad_requests_are_refused(engine, prompt, params, message):
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_ids_of_other_integer_types_get_the_tokens_of_plain_ints(engine):
    prompt = engine.tokenizer(HIKERS).input_ids
    as_numpy = list(np.asarray(prompt, dtype=np.int64))
    as_tensor = list(torch.tensor(prompt))
    got = engine.generate([as_numpy, as_tensor, prompt], TEN_TOKENS)
    assert got[0].token_ids == got[1].token_ids == got[2].token_ids


@pytest.mark.parametrize("fields", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}])
def test_bad_sampling_params_are_refused(fields):
    with pytest.raises(RequestError):
        SamplingParams(**fields)


def test_a_slow_stream_consumer_gets_merged_chunks_that_add_up(engine):
    prompt, params = HIKERS, TEN_TOKENS
    expected = engine.generate([prompt], params)[0]

    async def collect_slowly():
        chunks = []
        async for chunk in engine.stream(prompt, params):
            chunks.append(chunk)
            await asyncio.sleep(0.05)  # several steps finish meanwhile
        return chunks

    chunks = asyncio.run(collect_slowly())
    assert len(chunks) < 10  # merged
    _assert_adds_up(chunks, expected)


def test_a_paced_stream_merges_what_arrives_in_its_pause_and_its_end_ends_the_pause(engine):
    prompt, params = HIKERS, TEN_TOKENS
    expected = engine.generate([prompt], params)[0]

    async def collect():  # an hour's pause after each chunk: only the finishing token can end it
        return [chunk async for chunk in engine.stream(prompt, params, pause_s=lambda: 3600.0)]

    chunks = asyncio.run(asyncio.wait_for(collect(), 120))
    assert len(chunks) <= 2  # the first chunk, then everything up to the end
    _assert_adds_up(chunks, expected)


def test_a_pushed_stream_gets_every_steps_output_and_its_times(engine):
    prompt, params = HIKERS, TEN_TOKENS
    expected = engine.generate([prompt], params)[0]
    times = RequestTimes()

    async def run():
        got, ended = [], asyncio.Event()

        def put(out):
            got.append(out)
            if isinstance(out, BaseException) or out.finished:
                ended.set()

        request = engine.push_stream(prompt, params, None, None, times, "", put)
        await asyncio.wait_for(ended.wait(), 120)
        engine.end_push(request)
        return got

    got = asyncio.run(run())
    assert [len(out.token_ids) for out in got] == [1] * 10  # one output per step, none merged
    _assert_adds_up(got, expected)
    assert 0 < times.added_ns <= times.first_token_ns <= times.finished_ns


def test_ending_a_pushed_stream_early_aborts_and_frees_blocks(engine):
    free = engine.blocks.num_free

    async def read_two():
        got, two = [], asyncio.Event()

        def put(out):
            got.append(out)
            if len(got) == 2:
                two.set()

        request = engine.push_stream("The river", SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                                     None, None, None, "", put)
        await asyncio.wait_for(two.wait(), 120)
        engine.end_push(request)
        return got

    got = asyncio.run(read_two())
    assert 2 <= len(got) < 100 and got[-1].finish_reason is None
    assert engine.blocks.num_free == free and not engine.has_unfinished()
