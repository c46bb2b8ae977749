"""The engine's ready-to-copy host copies stay within max_staged_bytes (a registry larger
than the budget), the newest kept; an adapter whose copy was dropped is restaged when
placed and gives the same tokens. Over the budget, the copies of adapters in slots go
first (staging.trim_staged), then the oldest."""
from __future__ import annotations

from collections import OrderedDict

import torch

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.cache import tensor_nbytes
from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.staging import trim_staged
from tests.helpers.lora import make_peft_lora

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_staged_copies_stay_within_their_bytes(llama_dir, tmp_path):
    paths = {f"a{i}": make_peft_lora(llama_dir, tmp_path / f"a{i}", r=4, lora_alpha=8,
                                     target_modules=["q_proj", "v_proj"], seed=i) for i in range(5)}
    probe = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=64, max_loras=2)
    probe.load_adapter("a0", paths["a0"])
    one = tensor_nbytes(probe.adapters["a0"].staged)
    expected = probe.generate([[5, 6, 7]], GREEDY, adapter_ids=["a0"])[0].token_ids

    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=64, max_loras=2,
                                    max_staged_bytes=int(2.5 * one))
    for adapter_id, path in paths.items():
        engine.load_adapter(adapter_id, path)
        assert engine.staged_bytes <= int(2.5 * one)
    assert [a for a, x in engine.adapters.items() if x.staged] == ["a3", "a4"]  # the newest two
    assert engine.generate([[5, 6, 7]], GREEDY, adapter_ids=["a0"])[0].token_ids == expected  # restaged


def test_restaged_copies_count_towards_the_budget(llama_dir, tmp_path):
    paths = {f"a{i}": make_peft_lora(llama_dir, tmp_path / f"a{i}", r=4, lora_alpha=8,
                                     target_modules=["q_proj", "v_proj"], seed=i) for i in range(4)}
    probe = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=64, max_loras=4)
    probe.load_adapter("a0", paths["a0"])
    budget = int(2.5 * tensor_nbytes(probe.adapters["a0"].staged))

    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=64, max_loras=4, max_staged_bytes=budget)
    for adapter_id, path in paths.items():
        engine.load_adapter(adapter_id, path)
    for adapter_id in ("a0", "a1"):  # both dropped their copies: placing them stages them again
        engine.generate([[5, 6, 7]], GREEDY, adapter_ids=[adapter_id])
        assert engine.staged_bytes <= budget
        assert sum(tensor_nbytes(a.staged) for a in engine.adapters.values()) <= budget  # none held uncounted
    # the newest placed keeps its copy; the one placed before it, now in a slot, gave its copy up
    # before a3, which was never placed, did
    assert [a for a, x in engine.adapters.items() if x.staged] == ["a1", "a3"]


def _staged(*names: str) -> OrderedDict[str, Adapter]:
    """Adapters holding a 64-byte loading copy each, oldest first."""
    return OrderedDict((name, Adapter("lora", staged={"copy": torch.zeros(16)})) for name in names)


def test_copies_of_adapters_in_slots_go_first_then_the_oldest():
    staged = _staged("a", "b", "c", "d", "e")
    dropped = [staged[k] for k in ("b", "d")]
    trim_staged(staged, max_adapters=3, max_bytes=1 << 20, resident=lambda key: key in {"b", "d", "e"})
    assert list(staged) == ["a", "c", "e"]  # e is resident but the newest: it is being placed
    assert all(not adapter.staged for adapter in dropped)

    staged = _staged("a", "b", "c", "d")
    trim_staged(staged, max_adapters=4, max_bytes=2 * 64, resident=lambda key: key == "c")
    assert list(staged) == ["b", "d"]  # c (in a slot) first, then the oldest, a

    staged = _staged("a", "b")
    trim_staged(staged, max_adapters=1, max_bytes=0)
    assert list(staged) == ["b"]  # the newest stays even alone over the bytes
