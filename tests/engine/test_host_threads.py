"""torch's CPU threads in an engine process: the automatic share on a GPU, the user's setting
(EngineConfig.host_threads, OMP_NUM_THREADS) kept, CPU engines left alone, and applied when an
engine is built."""
from __future__ import annotations

import os

import pytest
import torch

from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.engine.host_threads import MAX_AUTO_THREADS, apply_host_threads, host_threads
from adapterserve.engine.sampling_params import SamplingParams


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("ranks", [1, 2, 4, 1000])
def test_a_gpu_engine_takes_its_share_of_the_cores(monkeypatch, ranks):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = (os.cpu_count() or 1) // ranks
    assert host_threads(EngineConfig(device="cuda:0"), ranks) == max(1, min(MAX_AUTO_THREADS, share))


def test_omp_num_threads_and_cpu_engines_keep_torch_s_setting(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert host_threads(EngineConfig(device="cuda"), 1) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert host_threads(EngineConfig(device="cpu"), 1) is None


def test_the_configured_count_wins_everywhere(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert host_threads(EngineConfig(device="cuda", host_threads=5), 4) == 5
    assert host_threads(EngineConfig(device="cpu", host_threads=2), 1) == 2


def test_apply_sets_the_process_threads(torch_threads):
    target = 1 if torch.get_num_threads() != 1 else 2
    apply_host_threads(EngineConfig(host_threads=target), 1)
    assert torch.get_num_threads() == target
    apply_host_threads(EngineConfig(), 1)  # CPU and automatic: unchanged
    assert torch.get_num_threads() == target


def test_building_an_engine_applies_it(torch_threads, llama_dir):
    target = 1 if torch.get_num_threads() != 1 else 2
    engine = Engine.from_pretrained(llama_dir, max_loras=2, max_lora_rank=8, num_kv_blocks=32, host_threads=target)
    assert torch.get_num_threads() == target
    assert engine.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids
