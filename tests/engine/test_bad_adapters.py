"""Every unfit adapter is refused with a clear error and the engine keeps serving."""
import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.errors import AdapterError
from tests.helpers.bad_adapters import BAD_CASES, PICKLE_SENTINEL, make_bad_adapter
from tests.helpers.lora import make_peft_lora

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92], [65, 35, 89]]


@pytest.fixture(scope="module")
def served(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("bad")
    good = make_peft_lora(llama_dir, root / "good", r=8, lora_alpha=16,
                          target_modules=["q_proj", "v_proj", "down_proj"], seed=1)
    engine = Engine.from_pretrained(llama_dir, max_lora_rank=32)
    engine.load_adapter("good", good)
    before = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, adapter_ids=["good", None])]
    return engine, good, root, before


def _still_serving(engine, before):
    assert engine.list_adapters() == ["good"]
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY, adapter_ids=["good", None])] == before
    assert engine.blocks.num_free == engine.config.num_kv_blocks


# Unsupported for a LoRA reader, but families the engine serves (tested in test_families.py).
SERVED_FAMILIES = {"ia3", "prefix_tuning"}


@pytest.mark.parametrize("case", sorted(set(BAD_CASES) - SERVED_FAMILIES))
def test_bad_adapter_is_refused(served, llama_dir, case):
    engine, good, root, before = served
    bad = make_bad_adapter(case, llama_dir, good, root / case)
    with pytest.raises(AdapterError) as info:
        engine.load_adapter(case, bad)
    assert len(str(info.value)) > 20
    assert not (bad / PICKLE_SENTINEL).exists()
    _still_serving(engine, before)


def test_rank_above_maximum_is_refused(served, llama_dir):
    engine, _, root, before = served
    big = make_peft_lora(llama_dir, root / "r64", r=64, lora_alpha=64, target_modules=["q_proj"], seed=2)
    with pytest.raises(AdapterError, match="64") as info:
        engine.load_adapter("big", big)
    assert "32" in str(info.value)
    _still_serving(engine, before)


def test_duplicate_id_is_refused(served):
    engine, good, _, before = served
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_adapter("good", good)
    _still_serving(engine, before)
