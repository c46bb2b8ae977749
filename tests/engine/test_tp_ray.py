"""Tensor parallelism with its worker placed by Ray (the session's local cluster): rank 1
is a Ray actor in a placement group, and the engine's greedy tokens for a base and a
LoRA request equal those of the engine at size 1; a killed worker actor breaks the engine
(EngineBroken naming it); closing the engine frees the group."""
from __future__ import annotations

import time

import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.errors import EngineBroken
from tests.engine.test_tp_engine import MODEL, SETTINGS
from tests.helpers.lora import make_peft_lora

BREAK_WAIT_S = 60.0


@pytest.fixture
def lora_dir(tmp_path):
    return make_peft_lora(MODEL, tmp_path / "lora", r=4, lora_alpha=8, target_modules="all-linear", seed=3)


def _generate_until_broken(engine: Engine, prompts, sampling) -> None:
    """Generate until the engine notices its dead worker (a killed actor's connection closes a
    moment after ray.kill returns)."""
    deadline = time.monotonic() + BREAK_WAIT_S
    while time.monotonic() < deadline:
        engine.generate(prompts, sampling)
        time.sleep(0.1)


def test_worker_placed_by_ray_matches_one_rank(ray_session, lora_dir):
    import ray
    from ray.util import placement_group_table

    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts, adapters = [[4, 5, 6, 7], [30, 31, 32]], [None, "lora"]
    tokens = []
    for size in (1, 2):
        engine = Engine.from_pretrained(MODEL, tensor_parallel_size=size, **{**SETTINGS, "tensor_parallel_launch": "ray"})
        try:
            if size == 2:
                assert engine.lockstep.workers[0].describe.startswith("Ray actor")
            engine.load_adapter("lora", lora_dir)
            tokens.append([o.token_ids for o in engine.generate(prompts, greedy, adapters)])
            if size == 2:  # its worker killed: the engine breaks, naming it
                ray.kill(ray.get_actor(engine.lockstep.workers[0].describe.removeprefix("Ray actor ")))
                with pytest.raises(EngineBroken, match="worker 1"):
                    _generate_until_broken(engine, prompts, greedy)
        finally:
            engine.close()
    assert tokens[0] == tokens[1]
    assert tokens[0][0] != tokens[0][1]
    live = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    assert not live, f"the engine left placement groups behind: {live}"
    assert ray.is_initialized()
