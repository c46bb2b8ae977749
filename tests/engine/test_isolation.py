"""Nothing one request does can hurt another: a request that fails while it is processed
ends alone (KV blocks and slot freed) and the others keep exactly their tokens; only a
step that fails as a whole breaks the engine, and then every call says so."""
import asyncio
import time

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.errors import AdapterNotFound, EngineBroken, Overloaded
from tests.helpers.lora import make_peft_lora

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The lighthouse keeper", "Hikers follow the path", "A quiet morning in"]


def _poisoned(params: SamplingParams) -> SamplingParams:
    """A stop list that slipped past validation (the boundary refuses it): raises in the
    stop-string check of the step that handles the request's first token."""
    object.__setattr__(params, "stop", (1,))
    return params


@pytest.fixture
def engine(llama_dir):
    return Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=128)


def test_a_request_failing_in_its_step_ends_alone(engine):
    expected = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    free = engine.blocks.num_free
    bad = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate([PROMPTS[0], "poison", *PROMPTS[1:]], [GREEDY, _poisoned(bad), GREEDY, GREEDY])
    assert [outs[0].token_ids, *[o.token_ids for o in outs[2:]]] == expected
    assert outs[1].finish_reason == "error" and isinstance(outs[1].error, TypeError)
    assert engine.blocks.num_free == free and not engine.has_unfinished() and engine.broken is None


def test_streams_go_on_while_one_fails(engine):
    expected = engine.generate(PROMPTS, GREEDY)

    async def run():
        async def collect(prompt, params):
            return [c async for c in engine.stream(prompt, params)]

        bad = collect("poison", _poisoned(SamplingParams(max_tokens=12, temperature=0.0)))
        return await asyncio.gather(bad, *(collect(p, GREEDY) for p in PROMPTS), return_exceptions=True)

    failed, *streams = asyncio.run(run())
    assert isinstance(failed, TypeError)
    for chunks, want in zip(streams, expected):
        assert sum((c.token_ids for c in chunks), []) == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
    assert not engine.has_unfinished()


def test_adapter_unloaded_while_its_request_waits_fails_that_request_only(engine, llama_dir, tmp_path):
    engine.load_adapter("sql", make_peft_lora(llama_dir, tmp_path / "sql", r=4, lora_alpha=8, target_modules=["q_proj"]))
    expected = engine.generate([PROMPTS[1]], GREEDY)[0].token_ids
    waiting = engine.add_request(PROMPTS[0], GREEDY, adapter_id="sql")
    other = engine.add_request(PROMPTS[1], GREEDY)
    engine.unload_adapter("sql", fail_queued=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert waiting.finish_reason == "error" and isinstance(waiting.error, AdapterNotFound)
    assert [o.error for o in outputs if o.request_id == waiting.request_id] == [waiting.error]
    assert other.output_ids == expected and engine.broken is None


def test_a_step_failing_as_a_whole_breaks_the_engine(engine):
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    run = engine.runner.run

    def device_fault(*args):  # what a sticky CUDA error looks like from the host
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner.run = device_fault
    with pytest.raises(EngineBroken, match="illegal memory access"):
        engine.step()
    engine.runner.run = run
    assert "illegal memory access" in engine.broken
    assert all(r.finish_reason == "error" and isinstance(r.error, EngineBroken) for r in requests)
    assert engine.blocks.num_free == 128 and not engine.has_unfinished()
    with pytest.raises(EngineBroken):
        engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(EngineBroken):
        engine.step()


def test_every_stream_hears_of_a_broken_engine(engine):
    async def run():
        streams = [engine.stream(p, GREEDY) for p in PROMPTS]
        firsts = [await anext(s) for s in streams]
        engine.runner.run = lambda *args: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory"))
        results = await asyncio.gather(*(_drain(s) for s in streams), return_exceptions=True)
        return firsts, results

    firsts, results = asyncio.run(run())
    assert all(f.token_ids for f in firsts)
    assert all(isinstance(r, EngineBroken) for r in results)


async def _drain(stream):
    return [c async for c in stream]


def test_a_full_queue_sheds_new_requests(llama_dir):
    engine = Engine.from_pretrained(llama_dir, block_size=4, max_queued_requests=2)
    kept = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    with pytest.raises(Overloaded, match="2 requests waiting") as refused:
        engine.add_request(PROMPTS[2], GREEDY)
    assert refused.value.retry_after_s > 0 and len(engine.requests) == 2
    engine.step()  # both start: the queue has room again
    engine.add_request(PROMPTS[2], GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert all(r.finish_reason == "length" for r in kept)


def test_seconds_without_progress_counts_only_while_work_waits(engine):
    assert engine.seconds_without_progress() == 0.0
    engine.add_request(PROMPTS[0], GREEDY)
    time.sleep(0.05)
    assert engine.seconds_without_progress() >= 0.05
    engine.step()
    assert engine.seconds_without_progress() < 0.05
    while engine.has_unfinished():
        engine.step()
    assert engine.seconds_without_progress() == 0.0


def test_prompt_token_ids_must_be_integers(engine):
    from adapterserve.errors import RequestError

    for bad in ([1.5, 2], [True, 3], ["7"]):
        with pytest.raises(RequestError, match="integers"):
            engine.add_request(bad, GREEDY)
    assert engine.generate([torch.tensor([5, 6, 7])], GREEDY)[0].finish_reason == "length"
