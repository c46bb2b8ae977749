"""The tensor-parallel all-reduce's choice of path (CPU): which messages go one-shot,
two-shot or to the group's own all-reduce, and the fallback where symmetric memory
cannot run (a gloo group on CPU, the "nccl" setting): join_group then gives no
symmetric all-reduce, says so in the log, and its sums are exact. A TP=2 engine on gloo
equal to TP=1 (the fallback in the whole engine) is tests/engine/test_tp_engine.py; the
symmetric paths themselves run on GPUs: test_symm_allreduce_gpu.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from adapterserve.config import TP_ALL_REDUCES, EngineConfig
from adapterserve.engine.tp.group import join_group, leave_group, step_all_reduce_bytes
from adapterserve.layers.symm_allreduce import (
    CHOICES,
    NCCL,
    ONE_SHOT,
    ONE_SHOT_MAX_BYTES,
    TWO_SHOT,
    TWO_SHOT_MAX_BYTES,
    choose_path,
    largest_symmetric_message,
    one_shot_max_bytes,
    symmetric_all_reduce,
)
from tests.layers.one_gpu_ranks import LogLines

MiB = 1 << 20
BIG = 1 << 30  # a buffer that holds any message of these cases


@pytest.mark.parametrize("world", [2, 4, 8])
def test_small_messages_go_one_shot_up_to_the_limit_inclusive(world):
    limit = ONE_SHOT_MAX_BYTES[world]
    for nbytes in (4, 16 * 1024, limit):
        assert choose_path(nbytes, torch.bfloat16, True, world, BIG) == ONE_SHOT, nbytes
    assert choose_path(limit + 16, torch.bfloat16, True, world, BIG) == TWO_SHOT


@pytest.mark.parametrize("world", [2, 4, 8])
def test_middle_messages_go_two_shot_and_large_ones_to_nccl(world):
    assert choose_path(TWO_SHOT_MAX_BYTES, torch.float32, True, world, BIG) == TWO_SHOT
    assert choose_path(TWO_SHOT_MAX_BYTES + 16, torch.float32, True, world, BIG) == NCCL


def test_world_sizes_without_a_two_shot_kernel_use_nccl_above_one_shot():
    limit = one_shot_max_bytes(3)
    assert choose_path(limit, torch.bfloat16, True, 3, BIG) == ONE_SHOT
    assert choose_path(limit + 16, torch.bfloat16, True, 3, BIG) == NCCL
    assert largest_symmetric_message(3) == limit
    assert largest_symmetric_message(4) == TWO_SHOT_MAX_BYTES


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64, torch.float8_e4m3fn])
def test_dtypes_the_kernels_do_not_reduce_go_to_nccl(dtype):
    assert choose_path(1024, dtype, True, 2, BIG) == NCCL


def test_unaligned_odd_empty_or_oversized_messages_go_to_nccl():
    assert choose_path(1024, torch.bfloat16, False, 2, BIG) == NCCL  # not contiguous or not 16-byte aligned
    assert choose_path(6, torch.bfloat16, True, 2, BIG) == NCCL  # 3 bf16: the kernels need 4-byte multiples
    assert choose_path(0, torch.bfloat16, True, 2, BIG) == NCCL
    assert choose_path(1 * MiB, torch.bfloat16, True, 2, 1 * MiB) == ONE_SHOT
    assert choose_path(1 * MiB + 16, torch.bfloat16, True, 2, 1 * MiB) == NCCL  # beyond the buffer


def test_a_step_s_largest_all_reduce_is_a_full_batch_of_hidden_states():
    config = EngineConfig(dtype="bfloat16", max_num_batched_tokens=8192)
    assert step_all_reduce_bytes(config, 8192) == 8192 * 8192 * 2
    assert step_all_reduce_bytes(EngineConfig(max_num_batched_tokens=64), 100) == 64 * 100 * 4


def test_the_layer_and_the_engine_config_offer_the_same_choices():
    assert CHOICES == TP_ALL_REDUCES


def test_an_unknown_choice_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"tensor_parallel_all_reduce must be one of \['auto', 'nccl'\], got 'mpi'"):
        symmetric_all_reduce(None, torch.device("cpu"), None, "mpi")
    with pytest.raises(ValueError, match="tensor_parallel_all_reduce must be one of"):
        EngineConfig(tensor_parallel_all_reduce="one_shot")


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory) -> Path:
    """Two spawned ranks joining a gloo group through join_group, once per choice."""
    root = tmp_path_factory.mktemp("gloo-allreduce")
    mp.start_processes(_rank_main, args=(root,), nprocs=2, start_method="spawn")
    return root


def _rank_main(rank: int, root: Path) -> None:
    torch.set_num_threads(1)
    facts = {}
    for index, choice in enumerate(("auto", "nccl")):
        messages, logger = LogLines(), logging.getLogger("adapterserve.layers")
        logger.addHandler(messages)
        logger.setLevel(logging.INFO)
        tp = join_group(f"file://{root / f'store-{index}'}", rank, 2, "cpu", choice, 1 * MiB)
        logger.removeHandler(messages)
        x = torch.arange(8.0) * (rank + 1)
        facts[choice] = {"symmetric": tp.symmetric is not None, "sum": tp.all_reduce_(x).tolist(),
                         "max": tp.all_reduce_(torch.tensor([float(rank)]), op="max").tolist(), "log": messages.lines}
        leave_group()
    (root / f"facts.{rank}.json").write_text(json.dumps(facts))


@pytest.mark.parametrize("choice", ["auto", "nccl"])
def test_a_gloo_group_sums_with_its_own_all_reduce_and_says_so(gloo_ranks, choice):
    for rank in range(2):
        facts = json.loads((gloo_ranks / f"facts.{rank}.json").read_text())[choice]
        assert not facts["symmetric"]
        assert facts["sum"] == (torch.arange(8.0) * 3).tolist()
        assert facts["max"] == [1.0]
        assert len(facts["log"]) == 1, facts["log"]
        line = facts["log"][0]
        assert line.startswith(f"tensor-parallel all-reduce, rank {rank}: ")
        if choice == "auto":
            assert "the group's gloo all-reduce (symmetric memory needs CUDA devices and NCCL)" in line
        else:
            assert "the group's gloo all-reduce (tensor_parallel_all_reduce='nccl')" in line
