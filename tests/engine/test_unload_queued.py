"""Unloading an adapter with requests queued for it: refused with a clear error (nothing
changes, the requests complete with their exact tokens), waited for while another thread
steps the engine, or ended on request; never a KeyError in the next step."""
from __future__ import annotations

import threading

import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.errors import AdapterInUse, AdapterNotFound
from tests.helpers.lora import make_peft_lora

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["The lighthouse keeper", "Hikers follow the path"]


@pytest.fixture
def engine(llama_dir, tmp_path):
    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=128)
    engine.load_adapter("sql", make_peft_lora(llama_dir, tmp_path / "sql", r=4, lora_alpha=8,
                                              target_modules=["q_proj", "v_proj"]))
    return engine


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_unloading_with_queued_requests_is_refused_and_changes_nothing(engine):
    expected = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, adapter_ids=["sql", None])]
    queued = engine.add_request(PROMPTS[0], GREEDY, adapter_id="sql")
    other = engine.add_request(PROMPTS[1], GREEDY)
    with pytest.raises(AdapterInUse, match="'sql' has 1 queued requests that have not started"):
        engine.unload_adapter("sql")
    assert "sql" in engine.list_adapters()
    _drain(engine)
    assert [queued.output_ids, other.output_ids] == expected and engine.broken is None
    engine.unload_adapter("sql")  # nothing queued now
    assert engine.list_adapters() == []


def test_unloading_waits_for_queued_requests_to_start(engine):
    expected = engine.generate([PROMPTS[0]], GREEDY, adapter_ids=["sql"])[0].token_ids
    queued = engine.add_request(PROMPTS[0], GREEDY, adapter_id="sql")
    stepping = threading.Thread(target=_drain, args=(engine,))
    stepping.start()
    engine.unload_adapter("sql", wait_s=60)  # returns once the request holds its slot
    stepping.join()
    assert queued.output_ids == expected and engine.list_adapters() == []
    assert sum(engine.slots.refs) == 0 and engine.broken is None


def test_waiting_without_progress_times_out_with_the_same_error(engine):
    engine.add_request(PROMPTS[0], GREEDY, adapter_id="sql")
    with pytest.raises(AdapterInUse, match="wait for them to start"):
        engine.unload_adapter("sql", wait_s=0.05)  # nobody steps the engine
    assert "sql" in engine.list_adapters()


def test_failing_queued_requests_ends_them_alone(engine):
    expected = engine.generate([PROMPTS[1]], GREEDY)[0].token_ids
    queued = engine.add_request(PROMPTS[0], GREEDY, adapter_id="sql")
    other = engine.add_request(PROMPTS[1], GREEDY)
    engine.unload_adapter("sql", fail_queued=True)
    _drain(engine)  # no KeyError: the queued request ends with a precise error
    assert queued.finish_reason == "error" and isinstance(queued.error, AdapterNotFound)
    assert other.output_ids == expected and engine.broken is None


def test_unloading_an_unknown_adapter_is_not_found(engine):
    with pytest.raises(AdapterNotFound, match="no adapter 'nope' is loaded"):
        engine.unload_adapter("nope", wait_s=1)
