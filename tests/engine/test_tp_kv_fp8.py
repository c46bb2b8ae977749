"""Tensor parallelism with an FP8 KV cache (CPU, gloo): each rank quantizes its own KV heads,
one scale per (token, head), so an engine of tensor_parallel_size 2 stores the bytes one rank
would and its greedy tokens equal one rank's on the mixed batch of every family. (A module of
its own: one tensor-parallel engine per process at a time.)"""
import pytest

from adapterserve import SamplingParams
from tests.engine.test_tp_engine import SETTINGS, _mixed_run, adapter_dirs, engine_pair  # noqa: F401


@pytest.fixture(scope="module")
def engines(adapter_dirs):  # noqa: F811
    yield from engine_pair(adapter_dirs, **SETTINGS, kv_cache_dtype="fp8")


def test_fp8_kv_cache_greedy_tokens_equal_one_rank(engines, adapter_dirs):  # noqa: F811
    names = [n for n in adapter_dirs if n != "head"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    one, two = (_mixed_run(engine, names, greedy) for engine in engines)
    assert one == two
    assert len({tuple(tokens) for tokens in one}) > len(names) // 2, "adapters changed nothing: a vacuous check"
