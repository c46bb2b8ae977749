"""Tensor parallelism over NCCL: the mixed batch of every family at TP=2 (and TP=4 on four
GPUs: the tiny model's 2 KV heads then each replicated on two ranks) gives TP=1's logits
(float32: the Triton kernels run IEEE float32 dots and cuBLAS no TF32, so |TP - TP=1| <=
1e-3 on logits up to ~15), and its decode step captured in a CUDA graph, the collectives
with it, replays the eager step's logits. The same with the all-reduces over symmetric
memory (one-shot, layers/symm_allreduce.py): eager and graph-replayed logits equal TP=1's,
and every sum of the run took the one-shot path (counted: no silent fall back to NCCL)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapterserve.layers.parallel import SINGLE, TensorParallel
from adapterserve.layers.symm_allreduce import NCCL, ONE_SHOT, symmetric_all_reduce
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
from tests.helpers.spawned import join_within
from tests.models.tp_mixed_batch import run_mixed_batch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adapterhub"
MODEL = FIXTURES / "tiny-llama"
ATOL = 1e-3
DEADLINE_S = 300  # a collective hung in capture must fail the test, not stall the run


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def setup(request, tmp_path_factory) -> dict:
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    root = tmp_path_factory.mktemp(f"tp{world}-gpu")
    adapters = {name: make_peft_adapter(MODEL, root / name, cfg, seed=i)
                for i, (name, cfg) in enumerate(family_configs().items())}
    adapters["lora-all"] = make_peft_lora(MODEL, root / "lora-all", r=8, lora_alpha=16, target_modules="all-linear")
    adapters["houlsby"] = FIXTURES / "llama-houlsby"
    lora = {"lora-all": adapters["lora-all"]}
    scenarios = {
        "mixed": (adapters, {"graph": True}),
        "stacked": (lora, {"stacked": True, "graph": True}),
        "one-shot": (adapters, {"graph": True, "symmetric": True}),
    }
    results = root / "results"
    results.mkdir()
    ranks = mp.start_processes(_rank_main, args=(world, root / "store", scenarios, results), nprocs=world,
                               join=False, start_method="spawn")
    exited = join_within(ranks, DEADLINE_S)
    done = all((results / f"done.{rank}").exists() for rank in range(world))
    if not done:
        pytest.fail(f"the TP={world} ranks did not finish their steps in {DEADLINE_S} s (a hung collective?)")
    return {"world": world, "scenarios": scenarios, "results": results, "exited": exited}


def _rank_main(rank: int, world: int, store: Path, scenarios: dict, results: Path) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    tp = TensorParallel(rank, world, dist.group.WORLD)
    symmetric = symmetric_all_reduce(dist.group.WORLD, torch.device("cuda", rank), None)
    with_symmetric = TensorParallel(rank, world, dist.group.WORLD, symmetric)
    for name, (adapters, options) in scenarios.items():
        options = dict(options)
        rank_tp = with_symmetric if options.pop("symmetric", False) else tp
        result = run_mixed_batch(MODEL, adapters, rank_tp, device=f"cuda:{rank}", **options)
        taken = dict(symmetric.taken) if symmetric is not None and rank_tp is with_symmetric else None
        torch.save({**result.__dict__, "taken": taken}, results / f"{name}.{rank}.pt")
    torch.cuda.synchronize()
    del with_symmetric, symmetric  # its peer mappings released while the group still stands
    (results / f"done.{rank}").touch()
    dist.destroy_process_group()  # the graphs are gone by now: a captured communicator may hang here otherwise


@pytest.mark.parametrize("name", ["mixed", "stacked", "one-shot"])
def test_tp_over_nccl_equals_tp1(setup, name):
    adapters, options = setup["scenarios"][name]
    options = {key: value for key, value in options.items() if key != "symmetric"}
    want = run_mixed_batch(MODEL, adapters, SINGLE, device="cuda:0", **options)
    for rank in range(setup["world"]):
        got = torch.load(setup["results"] / f"{name}.{rank}.pt")
        for step, (g, w) in enumerate(zip(got["logits"], want.logits)):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}")
        torch.testing.assert_close(got["graph_logits"], got["logits"][1], atol=1e-4, rtol=0)
    torch.testing.assert_close(want.graph_logits, want.logits[1], atol=1e-4, rtol=0)


def test_the_one_shot_run_summed_over_symmetric_memory_only(setup):
    for rank in range(setup["world"]):
        taken = torch.load(setup["results"] / f"one-shot.{rank}.pt")["taken"]
        assert taken is not None, f"rank {rank}: no symmetric all-reduce on these GPUs (see the rank's log line)"
        assert taken.get(ONE_SHOT, 0) > 0 and taken.get(NCCL, 0) == 0, taken


def test_one_shot_graph_replay_equals_eager_tp1(setup):
    adapters, _ = setup["scenarios"]["one-shot"]
    want = run_mixed_batch(MODEL, adapters, SINGLE, device="cuda:0")
    for rank in range(setup["world"]):
        got = torch.load(setup["results"] / f"one-shot.{rank}.pt")["graph_logits"]
        torch.testing.assert_close(got, want.logits[1], atol=ATOL, rtol=0, msg=lambda m, r=rank: f"rank {r}: {m}")


def test_ranks_exit_after_capturing_collectives(setup):
    """destroy_process_group returns once the graphs that captured its collectives are freed."""
    assert setup["exited"], "a rank hung in destroy_process_group after its steps"
