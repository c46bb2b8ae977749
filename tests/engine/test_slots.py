"""Adapter slots and pools: rows by rank, eviction by recency and load, slots held
while in use, pinned adapters."""
import numpy as np
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.engine.row_allocator import RowAllocator
from adapterserve.engine.slots import AdapterSlots
from adapterserve.errors import CapacityError
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


# eviction by heat (recency and load), on slots over a pool that holds anything


class _AnyPool:
    family = "any"

    def place(self, slot: int, adapter) -> bool:
        return True

    def clear(self, slot: int) -> None:
        pass


def _slots(num_slots: int, **kwargs) -> AdapterSlots:
    return AdapterSlots(num_slots, [_AnyPool()], **kwargs)


def _use(slots: AdapterSlots, *adapter_ids: str) -> None:
    """Acquire and release each in turn (one request each, run alone)."""
    for adapter_id in adapter_ids:
        slots.release(slots.acquire(adapter_id, object()))


def test_heat_is_a_decayed_count_of_acquires():
    slots = _slots(4, half_life=2.0)
    _use(slots, "a", "a", "b", "b")
    assert slots.heat("a") == pytest.approx(2 ** -1.5 + 2 ** -1)
    assert slots.heat("b") == pytest.approx(1 + 2 ** -0.5)
    assert slots.heat("never") == 0.0


def test_hot_adapter_is_kept_over_a_more_recently_used_cold_one():
    slots = _slots(3)
    _use(slots, *["hot"] * 5, "cold1", "cold2")  # hot is the longest idle
    _use(slots, "new")
    assert slots.is_resident("hot") and not slots.is_resident("cold1")
    lru = _slots(3, half_life=0)  # no memory of load: least recently used goes
    _use(lru, *["hot"] * 5, "cold1", "cold2", "new")
    assert not lru.is_resident("hot") and lru.is_resident("cold1")


def test_adapters_kept_for_waiting_requests_are_not_evicted():
    slots = _slots(2)
    _use(slots, "a", "b")
    assert slots.acquire("c", object(), keep={"a"}) is not None
    assert slots.is_resident("a") and not slots.is_resident("b")
    slots.release(slots.slot_of["c"])
    assert slots.acquire("d", object(), keep={"a", "c"}) is None  # every idle slot is kept: wait
    assert slots.is_resident("a") and slots.is_resident("c") and slots.loads == 3


def test_pinned_adapter_is_never_evicted():
    slots = _slots(2)
    pinned = slots.pin("p", object())
    assert slots.refs[pinned] == 1 and slots.num_pinned == 1 and slots.loads == 1
    _use(slots, *"abcd")  # the one free slot cycles
    assert slots.slot_of["p"] == pinned and slots.loads == 5
    held = slots.acquire("e", object())
    assert slots.acquire("f", object()) is None  # the unpinned slot is in use; p stays
    slots.release(held)
    slots.evict("p")  # unload unpins
    assert slots.num_pinned == 0 and not slots.is_resident("p") and slots.refs[pinned] == 0
    _use(slots, "f", "g")
    assert slots.is_resident("f") and slots.is_resident("g")  # both slots serve unpinned adapters


def test_unloading_a_pinned_adapter_in_use_frees_its_slot_when_done():
    slots = _slots(2)
    slot = slots.pin("p", object())
    assert slots.acquire("p", object()) == slot  # a request uses it
    slots.evict("p")
    assert slots.num_pinned == 0 and not slots.is_resident("p") and slots.refs[slot] == 1
    slots.release(slot)
    assert slots.refs[slot] == 0 and slot not in slots.adapter_in


def test_pinning_keeps_a_slot_for_unpinned_adapters():
    slots = _slots(3)
    slots.pin("p", object())
    slots.pin("q", object())
    with pytest.raises(CapacityError, match="at least one must stay free"):
        slots.pin("r", object())
    assert not slots.is_resident("r")
    assert slots.pin("p", object()) == slots.slot_of["p"] and slots.num_pinned == 2  # pinning twice: once
    one = _slots(1)
    with pytest.raises(CapacityError, match="max_loras"):
        one.pin("p", object())


def test_pinning_needs_a_slot_that_can_be_freed_now():
    slots = _slots(3)
    held = [slots.acquire(a, object()) for a in "ab"]
    slots.pin("p", object())  # the free slot
    slots.evict("p")
    slots.acquire("c", object())  # now every slot is in use by a request
    with pytest.raises(CapacityError, match="retry when requests finish"):
        slots.pin("q", object())
    slots.release(held[0])
    assert slots.pin("q", object()) == held[0]  # the idle one is evicted for it


# the same, through the engine


def _served(engine: Engine, stream: list) -> list[list[int]]:
    """One request of the stream arrives before each step; run until all are done."""
    requests, pending = [], list(stream)
    while pending or engine.has_unfinished():
        if pending:
            prompt, adapter_id, max_tokens = pending.pop(0)
            requests.append(engine.add_request(prompt, _greedy(max_tokens), adapter_id))
        engine.step()
    return [r.output_ids for r in requests]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _lru(engine: Engine) -> Engine:
    """The engine with eviction as it was: least recently used, waiting requests ignored."""
    engine.slots.half_life = 0
    engine.scheduler.acquire = lambda adapter_id, keep: engine._acquire_slot(adapter_id)
    return engine


def _zipf_stream(num_adapters: int, n: int, alpha: float, seed: int) -> list:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_adapters + 1) ** alpha
    picks = rng.choice(num_adapters, size=n, p=weights / weights.sum())
    return [(rng.integers(3, 500, size=int(rng.integers(3, 6))).tolist(), f"a{k}", int(rng.integers(1, 3)))
            for k in picks]


def test_zipf_stream_is_exact_under_eviction_and_loads_less_than_lru(llama_dir, tmp_path):
    paths = {f"a{i}": make_peft_lora(llama_dir, tmp_path / f"a{i}", r=4, lora_alpha=4,
                                     target_modules=["q_proj", "v_proj"], seed=i) for i in range(12)}
    # one arrival per step; over seeds this rule loads as often as LRU or less (here 33 against 36)
    stream = _zipf_stream(len(paths), 60, 1.2, seed=2)
    engines = [Engine.from_pretrained(llama_dir, max_loras=n, max_lora_rank=8) for n in (12, 3, 3)]
    for engine in engines:
        for name, path in paths.items():
            engine.load_adapter(name, path)
    roomy, tight, lru = engines[0], engines[1], _lru(engines[2])
    expected: dict[int, list[int]] = {}
    for name in {a for _, a, _ in stream}:  # each adapter alone
        mine = [i for i, (_, a, _) in enumerate(stream) if a == name]
        outs = roomy.generate([stream[i][0] for i in mine], [_greedy(stream[i][2]) for i in mine],
                              adapter_ids=[name] * len(mine))
        expected.update({i: o.token_ids for i, o in zip(mine, outs)})
    expected_in_order = [expected[i] for i in range(len(stream))]
    assert _served(tight, stream) == expected_in_order
    assert _served(lru, stream) == expected_in_order
    assert tight.slots.loads < lru.slots.loads
    assert sum(tight.slots.refs) == 0 and sum(lru.slots.refs) == 0


def test_waiting_requests_keep_their_adapter_resident(llama_dir, tmp_path):
    adapters = _adapters(llama_dir, tmp_path, [8, 8, 8])
    a, b, c = adapters
    engine = Engine.from_pretrained(llama_dir, max_loras=2, max_lora_rank=64)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    engine.generate([[1, 2, 3], [4, 5, 6]], GREEDY, adapter_ids=[a, b])  # a, b resident and idle
    engine.generate([[7, 8]], GREEDY, adapter_ids=[b])  # a is now the coldest
    slot_a = engine.slots.slot_of[a]
    base = engine.add_request([9, 9], GREEDY)  # the oldest waiting request
    cold = engine.add_request([1, 1], GREEDY, c)
    warm = engine.add_request([2, 2], GREEDY, a)  # c's placement must not evict a
    engine.step()
    assert cold.slot >= 0 and warm.slot == slot_a and not engine.slots.is_resident(b)
    assert engine.slots.loads == 3
    while engine.has_unfinished():
        engine.step()
    assert base.finished and cold.finished and warm.finished


def test_oldest_waiting_request_may_evict_what_others_wait_for(llama_dir, tmp_path):
    # otherwise a stream of requests for resident adapters could starve it
    a, c = _adapters(llama_dir, tmp_path, [8, 8]).items()
    engine = Engine.from_pretrained(llama_dir, max_loras=1, max_lora_rank=64)
    for name, path in (a, c):
        engine.load_adapter(name, path)
    engine.generate([[1, 2, 3]], GREEDY, adapter_ids=[a[0]])
    cold = engine.add_request([4, 5], GREEDY, c[0])
    warm = engine.add_request([6, 7], GREEDY, a[0])
    engine.step()
    assert cold.slot == 0 and warm.slot == -1  # a was evicted for the oldest
    while engine.has_unfinished():
        engine.step()
    assert warm.finish_reason == "length" and engine.slots.loads == 3


def test_pinned_adapter_is_placed_at_once_and_stays_until_unloaded(llama_dir, tmp_path):
    adapters = _adapters(llama_dir, tmp_path, [8, 8, 8, 8])
    (pinned, pinned_dir), *others = adapters.items()
    roomy = Engine.from_pretrained(llama_dir, max_loras=4, max_lora_rank=64)
    engine = Engine.from_pretrained(llama_dir, max_loras=2, max_lora_rank=64)
    for name, path in adapters.items():
        roomy.load_adapter(name, path)
    engine.load_adapter(pinned, pinned_dir, pinned=True)
    slot = engine.slots.slot_of[pinned]
    assert engine.slots.num_pinned == 1 and engine.slots.loads == 1 and engine.slots.refs[slot] == 1
    for name, path in others:
        engine.load_adapter(name, path)
    with pytest.raises(CapacityError, match="pinned"):
        engine.load_adapter("second-pin", pinned_dir, pinned=True)  # would leave no slot for the rest
    assert "second-pin" not in engine.list_adapters() and engine.slots.num_pinned == 1
    prompts = [torch.randint(3, 500, (5,)).tolist() for _ in range(8)]
    ids = [list(adapters)[i % 4] for i in range(8)]
    expected = [o.token_ids for o in roomy.generate(prompts, GREEDY, adapter_ids=ids)]
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, adapter_ids=ids)] == expected
    assert engine.slots.slot_of[pinned] == slot and engine.slots.loads == 4  # the others took turns
    engine.unload_adapter(pinned)  # unpins and frees the slot
    assert engine.slots.num_pinned == 0 and not engine.slots.is_resident(pinned) and sum(engine.slots.refs) == 0
    engine.load_adapter(pinned, pinned_dir)
    assert not engine.slots.is_resident(pinned)  # unpinned adapters load on demand


def test_requests_wait_until_their_adapters_copies_have_landed(llama_dir, tmp_path):
    (name, path), = _adapters(llama_dir, tmp_path, [8]).items()
    engine = Engine.from_pretrained(llama_dir)
    engine.load_adapter(name, path)
    expected = engine.generate([[5, 6, 7]], GREEDY, adapter_ids=[name])[0].token_ids
    engine.unload_adapter(name)
    engine.load_adapter(name, path)
    _copies_land_after(engine.slots, 3)  # on the fourth look
    base = engine.add_request([9, 10, 11], GREEDY)
    waiting = engine.add_request([5, 6, 7], GREEDY, name)
    for _ in range(3):
        engine.step()
        assert waiting.status.value == "waiting" and waiting.slot == -1  # not admitted, base runs on
    assert engine.slots.is_resident(name) and sum(engine.slots.refs) == 0  # placed, held by nobody yet
    assert engine.slots.heat(name) == 0.0  # waiting is no use
    engine.step()
    assert waiting.slot >= 0 and engine.slots.heat(name) == 1.0  # admitted once the copies landed
    while engine.has_unfinished():
        engine.step()
    assert waiting.output_ids == expected and base.finish_reason == "length" and engine.slots.loads == 2


# copies landing on a copy stream, simulated: a fake CUDA event per placement


class _Copies:
    """A placement's copies in flight: its event's query() is False for ``looks`` looks."""

    def __init__(self, looks: int) -> None:
        self.looks = looks

    def query(self) -> bool:
        self.looks -= 1
        return self.looks < 0


def _copies_land_after(slots: AdapterSlots, looks: int) -> None:
    """From now on each placement's copies land only after ``looks`` looks, as on a busy
    copy stream."""
    place_in = slots._place_in

    def placing(slot: int, adapter) -> bool:
        placed = place_in(slot, adapter)
        slots._landing[slot] = _Copies(looks)
        return placed

    slots._place_in = placing


def test_acquire_neither_holds_nor_counts_a_slot_whose_copies_are_landing():
    slots = _slots(2)
    _copies_land_after(slots, 3)
    for _ in range(3):
        assert slots.acquire("a", object()) is None
    assert slots.is_resident("a") and slots.loads == 1 and slots.refs == [0, 0]
    assert slots.heat("a") == 0.0 and slots.heat("b") == 0.0
    slot = slots.acquire("a", object())  # landed
    assert slot is not None and slots.refs[slot] == 1 and slots.heat("a") == 1.0


def test_a_landing_adapter_is_kept_for_its_waiting_requests_but_not_from_the_oldest():
    slots = _slots(1)
    _copies_land_after(slots, 5)
    assert slots.acquire("a", object()) is None  # placed, landing
    assert slots.acquire("b", object(), keep={"a"}) is None and slots.is_resident("a")
    assert slots.acquire("b", object()) is None  # for the oldest request: a goes
    assert slots.is_resident("b") and not slots.is_resident("a") and slots.loads == 2


def test_pinning_holds_the_slot_at_once_and_requests_wait_for_the_copies():
    slots = _slots(3)
    _copies_land_after(slots, 2)
    slot = slots.pin("p", object())
    assert slots.refs[slot] == 1 and slots.num_pinned == 1
    assert slots.acquire("p", object()) is None and slots.acquire("p", object()) is None
    assert slots.acquire("p", object()) == slot and slots.refs[slot] == 2


def test_waiting_for_copies_to_land_does_not_make_an_adapter_hot(llama_dir, tmp_path):
    adapters = _adapters(llama_dir, tmp_path, [8, 8, 8])
    hot, slow, new = adapters
    engine = Engine.from_pretrained(llama_dir, max_loras=2, max_lora_rank=64)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    engine.generate([[1, 2, 3], [4, 5, 6]], GREEDY, adapter_ids=[hot, hot])  # used twice
    _copies_land_after(engine.slots, 6)
    engine.generate([[7, 8, 9]], GREEDY, adapter_ids=[slow])  # used once, after six steps waiting
    assert engine.slots.heat(slow) < engine.slots.heat(hot)
    engine.add_request([1, 1], GREEDY, new)
    engine.step()  # new's placement evicts the coldest
    assert engine.slots.is_resident(hot) and engine.slots.is_resident(new) and not engine.slots.is_resident(slow)
    while engine.has_unfinished():
        engine.step()
