"""Adapter slots and pools: rows by rank, LRU eviction, pinning while in use."""
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.engine.row_allocator import RowAllocator
from tests.helpers.lora import make_peft_lora

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_row_allocator_first_fit_and_merge():
    rows = RowAllocator(64)
    a, b, c = rows.alloc(16), rows.alloc(32), rows.alloc(16)
    assert (a, b, c) == (0, 16, 48) and rows.alloc(1) is None
    rows.free(a, 16)
    rows.free(c, 16)
    assert rows.alloc(32) is None  # two separate holes of 16
    rows.free(b, 32)
    assert rows.free_rows == 64 and rows.alloc(64) == 0


def _adapters(model_dir, tmp_path, ranks):
    return {
        f"a{i}-r{r}": make_peft_lora(model_dir, tmp_path / f"a{i}", r=r, lora_alpha=r, target_modules=["q_proj", "v_proj"], seed=i)
        for i, r in enumerate(ranks)
    }


def test_small_ranks_take_only_their_rows(llama_dir, tmp_path):
    # room for one rank-64 adapter per pool, but four rank-16 adapters fit beside each other
    engine = Engine.from_pretrained(llama_dir, max_loras=4, max_lora_rank=64, lora_pool_rows=64)
    adapters = _adapters(llama_dir, tmp_path, [16, 16, 16, 16])
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    requests = [engine.add_request([1, 2, 3], GREEDY, name) for name in adapters]
    engine.step()
    assert all(r.slot >= 0 for r in requests)
    assert len({r.slot for r in requests}) == 4
    assert engine.lora_pool.allocators["q_proj"].free_rows == 0
    assert engine.lora_pool.allocators["k_proj"].free_rows == 64  # untargeted kinds take no rows


def test_more_adapters_than_slots_are_served_by_eviction(llama_dir, tmp_path):
    ranks = [8, 64, 4, 16, 32, 8]
    adapters = _adapters(llama_dir, tmp_path, ranks)
    roomy = Engine.from_pretrained(llama_dir, max_loras=8, max_lora_rank=64)
    tight = Engine.from_pretrained(llama_dir, max_loras=2, max_lora_rank=64, lora_pool_rows=80)
    for engine in (roomy, tight):
        for name, path in adapters.items():
            engine.load_adapter(name, path)
    prompts = [torch.randint(3, 500, (7,)).tolist() for _ in range(12)]
    ids = [list(adapters)[i % len(adapters)] for i in range(12)]
    expected = [o.token_ids for o in roomy.generate(prompts, GREEDY, adapter_ids=ids)]
    assert [o.token_ids for o in tight.generate(prompts, GREEDY, adapter_ids=ids)] == expected
    assert sum(tight.slots.refs) == 0


def test_slot_in_use_is_never_evicted(llama_dir, tmp_path):
    adapters = _adapters(llama_dir, tmp_path, [8, 8])
    engine = Engine.from_pretrained(llama_dir, max_loras=1, max_lora_rank=64)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    first, second = list(adapters)
    long = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), first)
    waiting = engine.add_request([4, 5, 6], GREEDY, second)
    engine.step()
    assert long.slot == 0 and waiting.slot == -1  # second waits for the only slot
    while not long.finished:
        engine.step()
        assert engine.slots.slot_of.get(first) == 0 or long.finished
    while engine.has_unfinished():
        engine.step()
    assert waiting.finish_reason == "length"


def test_unload_while_in_use_finishes_running_requests(llama_dir, tmp_path):
    adapters = _adapters(llama_dir, tmp_path, [8])
    name, path = next(iter(adapters.items()))
    engine = Engine.from_pretrained(llama_dir)
    engine.load_adapter(name, path)
    expected = engine.generate([[7, 8, 9]], GREEDY, adapter_ids=[name])[0].token_ids
    running = engine.add_request([7, 8, 9], GREEDY, name)
    engine.step()
    engine.unload_adapter(name)
    while engine.has_unfinished():
        engine.step()
    assert running.output_ids == expected
    assert not engine.slots.slot_of and sum(engine.slots.refs) == 0  # slot freed once done


def test_reloading_an_id_in_use_places_the_new_weights(llama_dir, tmp_path):
    old_dir, new_dir = _adapters(llama_dir, tmp_path, [8, 16]).values()
    engine = Engine.from_pretrained(llama_dir)
    engine.load_adapter("x", new_dir)
    expected = engine.generate([[7, 8, 9]], GREEDY, adapter_ids=["x"])[0].token_ids
    engine.unload_adapter("x")
    engine.load_adapter("x", old_dir)
    running = engine.add_request([7, 8, 9], SamplingParams(max_tokens=20, temperature=0.0), "x")
    engine.step()
    engine.unload_adapter("x")
    engine.load_adapter("x", new_dir)
    assert engine.generate([[7, 8, 9]], GREEDY, adapter_ids=["x"])[0].token_ids == expected
    while engine.has_unfinished():
        engine.step()
    assert running.finish_reason is not None and sum(engine.slots.refs) == 0
