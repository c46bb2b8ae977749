"""Hostile tensor-parallel settings (`serve --tensor-parallel-size`, engine.tensor_parallel_size,
engine.tensor_parallel_launch): refused before anything starts, naming the setting; a good
size reserves one bundle per rank on one node for each replica."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from adapterserve.clients import cli
from adapterserve.server.app import build_app
from adapterserve.server.engine_process.placement import replica_placement

MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"


@pytest.mark.parametrize("size", [0, -1, 2.5, "2", None, True, [], {"n": 2}, math.nan, math.inf])
def test_a_bad_size_is_refused_before_anything_starts(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer of at least 1"):
        build_app({"model": str(MODEL), "encoder": False, "engine": {"tensor_parallel_size": size}})


@pytest.mark.parametrize("launch", ["slurm", "", None, 1])
def test_a_bad_launch_is_refused(launch):
    with pytest.raises(ValueError, match="tensor_parallel_launch must be one of"):
        build_app({"model": str(MODEL), "encoder": False,
                   "engine": {"tensor_parallel_size": 2, "tensor_parallel_launch": launch}})


@pytest.mark.parametrize("flag", ["0", "-3"])
def test_the_flag_refuses_sizes_below_one(flag):
    args = cli._parser().parse_args(["serve", "--model", str(MODEL), "--no-encoder", "--tensor-parallel-size", flag])
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer of at least 1"):
        build_app(cli.serve_config(args))


def test_the_flag_refuses_a_non_integer():
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--tensor-parallel-size", "two"])


def test_a_good_size_reserves_a_bundle_per_rank_on_one_node():
    gpu = replica_placement({"device": "cuda", "tensor_parallel_size": 4}, {"num_cpus": 1, "num_gpus": 1})
    assert gpu == {"placement_group_bundles": [{"CPU": 1.0, "GPU": 1.0}] + [{"GPU": 1.0}] * 3,
                   "placement_group_strategy": "STRICT_PACK"}
    assert replica_placement({"device": "cuda", "tensor_parallel_size": 1}, {"num_cpus": 1, "num_gpus": 1}) == {}
