"""The host-built attention metadata: decode steps carry a longest-first launch order."""
import numpy as np
import torch

from adapterserve.engine.attention_meta import SequenceLayout, build_attention_meta, longest_first


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
