"""EngineProcess without Ray: the engine in a child process gives what the engine gives
in-process (streams, adapters, classify, embed), aborts free KV blocks, request errors
keep their type and message, and the child ends on close() and when the pipe drops."""
from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.formats.read import read_adapter
from adapterserve.errors import AdapterError, AdapterNotFound, EngineDied, RequestError
from adapterserve.server.engine_process import EngineProcess, LocalEngine, start_engine, wire

ENGINE = {"max_lora_rank": 16, "max_loras": 4, "num_kv_blocks": 32}
PROMPTS = ["The lighthouse keeper", "To make bread you need", [0, 347, 411, 23]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
EXAMPLES = Path(__file__).parents[2] / "examples" / "adapters"


@pytest.fixture(scope="module")
def proc(tiny_model):
    engine = EngineProcess(tiny_model, ENGINE)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def local(tiny_model):
    return Engine.from_pretrained(tiny_model, **ENGINE)


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]


def _joined(chunks) -> tuple[list[int], str, str | None]:
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_streams_equal_the_engine_in_process(proc, local):
    async def run():
        return await asyncio.gather(*[_collect(proc.stream(p, GREEDY, request_id=f"r{i}"))
                                      for i, p in enumerate(PROMPTS)])

    expected = local.generate(PROMPTS, GREEDY)
    for i, (chunks, want) in enumerate(zip(asyncio.run(run()), expected)):
        assert _joined(chunks) == (want.token_ids, want.text, want.finish_reason)
        assert {c.request_id for c in chunks} == {f"r{i}"}
        assert chunks[0].prompt_token_ids == chunks[-1].prompt_token_ids == want.prompt_token_ids


def test_a_paced_stream_merges_its_tokens_and_is_not_held_past_its_end(proc, local):
    async def run():  # an hour's pause after each chunk: only each stream's last token can end it
        streams = [proc.stream(p, GREEDY, request_id=f"paced{i}", pause_s=lambda: 3600.0)
                   for i, p in enumerate(PROMPTS)]
        return await asyncio.wait_for(asyncio.gather(*[_collect(s) for s in streams]), 120)

    expected = local.generate(PROMPTS, GREEDY)
    for chunks, want in zip(asyncio.run(run()), expected):
        assert len(chunks) <= 2  # the first chunk, then everything up to the end
        assert _joined(chunks) == (want.token_ids, want.text, want.finish_reason)


def test_concurrent_streams_arrive_in_one_message_per_step(proc, monkeypatch):
    """Relaying costs one pipe message per engine step, whatever the number of streams."""
    sizes, deliver = [], proc._deliver
    monkeypatch.setattr(proc, "_deliver", lambda entries: (sizes.append(len(entries)), deliver(entries)))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run():
        return await asyncio.gather(*[_collect(proc.stream(f"prompt {i}", params)) for i in range(6)])

    assert all(len(_joined(chunks)[0]) == 12 for chunks in asyncio.run(run()))
    assert sum(sizes) >= 6 * 2 and len(sizes) <= 12 + 2, sizes


def test_a_burst_started_in_one_loop_turn_reaches_one_engine_step(proc, local):
    """The streams a replica starts in one loop turn cross in one message and are planned
    together: their prompts run in the same first step (one step of 2 tokens: prefill + decode)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [f"burst {i}" for i in range(8)]

    async def steps() -> float:
        return (await proc.stats()).stats.step_seconds.count

    async def run():
        before = await steps()
        outs = await asyncio.gather(*[_collect(proc.stream(p, params)) for p in prompts])
        return outs, await steps() - before

    outs, taken = asyncio.run(run())
    assert taken == 2, f"the burst took {taken} steps"
    for chunks, want in zip(outs, local.generate(prompts, params)):
        assert _joined(chunks)[0] == want.token_ids


def test_a_message_sent_in_the_turn_a_stream_started_goes_after_its_start(proc, monkeypatch):
    """A start waits for the end of its loop turn; anything sent before then (an abort) takes the
    waiting starts first, so the child never sees an abort before its stream."""
    sent, send = [], proc._conn.send_bytes
    monkeypatch.setattr(proc._conn, "send_bytes", lambda payload: (sent.append(wire.decode(payload)[0]),
                                                                   send(payload)))

    async def run():
        stream = proc.stream("To make bread you need", LONG)
        task = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the stream has started; its start waits for the end of the turn
        proc.discard_adapter("not-loaded")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()

    asyncio.run(run())
    assert sent[:2] == ["streams", "call"], sent


def test_closing_a_stream_early_aborts_it_and_frees_its_blocks(proc):
    async def run():
        idle = await proc.load()
        assert idle.requests == 0
        stream = proc.stream("To make bread you need", LONG)
        for _ in range(3):
            await anext(stream)
        busy = await proc.load()
        assert busy.requests == 1 and busy.free_kv_blocks < idle.free_kv_blocks
        await stream.aclose()
        await _until(lambda: _is(proc, idle), "the aborted request's blocks")

        task = asyncio.create_task(_collect(proc.stream("A server", LONG)))  # cancelling its consumer aborts too
        await _until(lambda: _busy(proc), "the request to run")
        task.cancel()
        await _until(lambda: _is(proc, idle), "the cancelled request's blocks")

    asyncio.run(run())


async def _is(proc: EngineProcess, load) -> bool:
    return await proc.load() == load


async def _busy(proc: EngineProcess) -> bool:
    return (await proc.load()).running == 1


def test_request_errors_keep_their_type_and_message(proc, local):
    bad = [
        (RequestError, lambda e: e.stream([0, 10**6], GREEDY)),
        (AdapterNotFound, lambda e: e.stream("hi", GREEDY, adapter_id="nope")),
        (RequestError, lambda e: e.classify(["hi"], None)),
    ]
    for kind, call in bad:
        with pytest.raises(kind) as here:
            asyncio.run(_drain(call(local)))
        with pytest.raises(kind) as there:
            asyncio.run(_drain(call(proc)))
        assert str(there.value) == str(here.value)
    with pytest.raises(AdapterNotFound, match="no adapter 'nope' is loaded"):
        asyncio.run(proc.unload_adapter("nope"))
    assert asyncio.run(_collect(proc.stream("still serving", GREEDY)))[-1].finished


async def _drain(result) -> None:
    if hasattr(result, "__aiter__"):
        await _collect(result)
    else:
        await result


def test_an_adapter_added_through_the_proxy_is_used_then_unloaded(proc, local, lora_dirs):
    facts = proc.facts
    adapter = read_adapter(lora_dirs["chat"], facts.backbone_spec, facts.adapter_limits)
    local.load_adapter("chat", lora_dirs["chat"])
    expected = local.generate(PROMPTS, GREEDY, adapter_ids=["chat"] * len(PROMPTS))
    base = local.generate(PROMPTS[:1], GREEDY)[0]

    async def run():
        await proc.add_adapter("chat", adapter)
        with pytest.raises(AdapterError, match="already loaded"):
            await proc.add_adapter("chat", adapter)
        streams = [_collect(proc.stream(p, GREEDY, adapter_id="chat")) for p in PROMPTS]
        served = await asyncio.gather(*streams)
        embedded = await proc.embed(PROMPTS[:2], "chat")
        await proc.unload_adapter("chat")
        return served, embedded

    served, embedded = asyncio.run(run())
    for chunks, want in zip(served, expected):
        assert _joined(chunks) == (want.token_ids, want.text, want.finish_reason)
        assert chunks[-1].adapter_id == "chat"
    assert expected[0].token_ids != base.token_ids, "the adapter must change the output"
    for got, want in zip(embedded, local.embed(PROMPTS[:2], "chat")):
        assert got.embedding == pytest.approx(want.embedding, abs=1e-5)
    with pytest.raises(AdapterNotFound, match="no adapter 'chat' is loaded"):
        asyncio.run(_collect(proc.stream("hi", GREEDY, adapter_id="chat")))


def test_the_in_process_engine_offers_the_same_api(proc, tiny_model):
    here = start_engine(tiny_model, ENGINE, own_process=False)
    assert isinstance(here, LocalEngine) and here.facts == proc.facts

    async def run(engine):
        return _joined(await _collect(engine.stream(PROMPTS[0], GREEDY))), await engine.load()

    assert asyncio.run(run(here)) == asyncio.run(run(proc))


def test_encoder_classifies_and_embeds_then_close_ends_the_child():
    from adapterserve.engine.encoder_engine import EncoderEngine
    from adapterserve.models.encoder_loader import default_encoder_dir

    texts = ["what a wonderful, moving film", "the striker scored twice"]
    local = EncoderEngine.from_pretrained(default_encoder_dir())
    local.load_adapter("sentiment", EXAMPLES / "sentiment-lora")
    proc = EngineProcess(default_encoder_dir())
    try:
        assert proc.facts.encoder and proc.facts.num_kv_blocks == 0
        adapter = read_adapter(EXAMPLES / "sentiment-lora", proc.facts.backbone_spec, proc.facts.adapter_limits)

        async def run():
            await proc.add_adapter("sentiment", adapter)
            return await proc.classify(texts, "sentiment"), await proc.embed(texts, None)

        classified, embedded = asyncio.run(run())
        for got, want in zip(classified, local.classify(texts, "sentiment")):
            assert (got.label, got.labels) == (want.label, want.labels)
            assert got.probabilities == pytest.approx(want.probabilities, abs=1e-5)
        for got, want in zip(embedded, local.embed(texts)):
            assert got.embedding == pytest.approx(want.embedding, abs=1e-5)
        with pytest.raises(RequestError, match="encoder"):
            asyncio.run(_collect(proc.stream("hi", GREEDY)))
    finally:
        proc.close()
    assert proc._process.exitcode == 0 and not proc.alive
    with pytest.raises(EngineDied, match="closed"):
        asyncio.run(proc.embed(texts))


def test_the_child_exits_when_the_pipe_drops_and_waiters_fail(tiny_model):
    proc = EngineProcess(tiny_model, ENGINE)

    async def run():
        stream = proc.stream("The lighthouse keeper", LONG)
        await anext(stream)
        _drop(proc)  # as when the replica's process dies
        with pytest.raises(EngineDied, match="exited"):
            await _collect(stream)

    try:
        asyncio.run(run())
        proc._process.join(30)
        assert proc._process.exitcode == 0
        with pytest.raises(EngineDied):
            asyncio.run(proc.load())
    finally:
        proc.close()


def _drop(proc: EngineProcess) -> None:
    """Shut the parent's end of the pipe down: the child reads EOF, as when its parent dies."""
    with socket.socket(fileno=os.dup(proc._conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)
