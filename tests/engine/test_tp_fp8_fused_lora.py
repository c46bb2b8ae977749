"""Tensor parallelism with lora_decode="fused" on an FP8 backbone (CPU, gloo): each rank keeps
its part of the A rows apart from its e4m3 weights (A's input columns on row-parallel layers,
whole on column-parallel ones), steps of few adapters run the fused linear and the others the
segment kernels, and the greedy tokens of tensor_parallel_size 2 equal one rank's on the mixed
batch of every family. (A module of its own: one tensor-parallel engine per process at a time.)"""
import pytest

from adapterserve import SamplingParams
from adapterserve.layers import linear as linear_module
from tests.engine.test_tp_engine import SETTINGS, _mixed_run, adapter_dirs, engine_pair  # noqa: F401


@pytest.fixture(scope="module")
def engines(adapter_dirs):  # noqa: F811
    yield from engine_pair(adapter_dirs, **SETTINGS, dtype="fp8", lora_decode="fused")


def test_fused_fp8_lora_greedy_tokens_equal_one_rank(engines, adapter_dirs, monkeypatch):  # noqa: F811
    calls = []
    real = linear_module.fused_lora_linear
    monkeypatch.setattr(linear_module, "fused_lora_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    for engine in engines:
        stacks = [linear.stacked for _, linear in engine.model.adapter_linears()]
        assert stacks and all(s is not None and not s.joint for s in stacks), "A rows kept apart on every linear"
    names = [n for n in adapter_dirs if n != "head"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    one, two = (_mixed_run(engine, names, greedy) for engine in engines)
    assert one == two
    assert calls, "steps of few adapters ran the fused linear (rank 0 of each engine)"
    assert len({tuple(tokens) for tokens in one}) > len(names) // 2, "adapters changed nothing: a vacuous check"
