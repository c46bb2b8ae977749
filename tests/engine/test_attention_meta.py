"""The host-built attention metadata: decode steps carry a longest-first launch order; block
tables and write slots as per-sequence loops compute them; a step's inputs survive pickling
(rank 0 sends them to the other tensor-parallel ranks)."""
import pickle
import random

import numpy as np
import torch

from adapterserve.engine.attention_meta import (
    SequenceLayout,
    block_tables,
    build_attention_meta,
    longest_first,
)
from adapterserve.engine.step_device import StepInputs


def test_longest_first_puts_padding_last_and_keeps_ties_in_row_order():
    lens = np.array([5, 0, 9, 5, 12, 0], dtype=np.int32)
    order = longest_first(lens)
    assert order.dtype == np.int32
    assert order.tolist() == [4, 2, 0, 3, 1, 5]


def test_decode_steps_get_an_order_and_prefill_steps_none():
    decode = [SequenceLayout([3, 4], 0, 20, 1), SequenceLayout([7], 0, 9, 1), SequenceLayout([1, 2, 5], 0, 33, 1)]
    meta = build_attention_meta(decode, 16, torch.device("cpu"))
    assert meta.decode and meta.decode_order.tolist() == [2, 0, 1]
    prefill = [SequenceLayout([3, 4], 0, 20, 20), SequenceLayout([7], 0, 9, 1)]
    meta = build_attention_meta(prefill, 16, torch.device("cpu"))
    assert not meta.decode and meta.decode_order is None


def _random_layouts(rng: random.Random, count: int, page: int) -> list[SequenceLayout]:
    layouts = []
    for _ in range(count):
        pages = rng.sample(range(1000), rng.randint(1, 6))
        context = rng.randint((len(pages) - 1) * page + 1, len(pages) * page)
        layouts.append(SequenceLayout(pages, rng.randint(0, 3), context, rng.randint(1, min(context, 5))))
    return layouts


def test_block_tables_and_write_slots_match_a_loop_over_the_sequences():
    rng, page = random.Random(0), 4
    layouts = _random_layouts(rng, 9, page)
    tables = block_tables(layouts, 12, 7)
    want = np.zeros((12, 7), dtype=np.int32)
    for row, s in enumerate(layouts):
        want[row, : len(s.pages)] = s.pages
    assert tables.dtype == np.int32 and (tables == want).all()
    meta = build_attention_meta(layouts, page, torch.device("cpu"))
    slots = [s.pages[k // page] * page + k % page for s in layouts for k in range(s.first_kv, s.context_len)]
    assert meta.write_slots.tolist() == slots
    assert meta.block_tables.tolist() == want[:9, : max(len(s.pages) for s in layouts)].tolist()


def test_step_inputs_survive_pickling():
    layouts = _random_layouts(random.Random(1), 5, 4)
    inputs = StepInputs(ids=[3, 0, 9], positions=[7, 8, 9], layouts=layouts, slots=[-1, 2, 2], last_rows=[0, 1, 2],
                        sources=[-1, 4, -1], virtual=([1], [2], [0]), family_slots=np.array([[-1, 2, 2]] * 3),
                        generating=[0, 2], graph=True, signature=((64,), (), ()))
    back = pickle.loads(pickle.dumps(("step", inputs), protocol=pickle.HIGHEST_PROTOCOL))[1]
    fields = ("pages", "kv_start", "context_len", "new_tokens", "first_kv")
    assert [[getattr(s, f) for f in fields] for s in back.layouts] == [[getattr(s, f) for f in fields] for s in layouts]
    assert all(type(s) is SequenceLayout for s in back.layouts) and inputs.layouts is layouts
    for name in ("ids", "positions", "slots", "last_rows", "sources", "virtual", "generating", "graph", "signature"):
        assert getattr(back, name) == getattr(inputs, name), name
    assert (back.family_slots == inputs.family_slots).all()
