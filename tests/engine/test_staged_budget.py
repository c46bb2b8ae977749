"""The engine's ready-to-copy host copies stay within max_staged_bytes (a registry larger
than the budget), the newest kept; an adapter whose copy was dropped is restaged when
placed and gives the same tokens."""
from __future__ import annotations

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.cache import tensor_nbytes
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
    assert [a for a, x in engine.adapters.items() if x.staged] == ["a0", "a1"]  # the newest placed
