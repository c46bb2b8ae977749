"""Tensor parallelism over NCCL: the mixed batch of every family at TP=2 (and TP=4 on four
GPUs: the tiny model's 2 KV heads then each replicated on two ranks) gives TP=1's logits
(float32: the Triton kernels run IEEE float32 dots and cuBLAS no TF32, so |TP - TP=1| <=
1e-3 on logits up to ~15), and its decode step captured in a CUDA graph, the collectives
with it, replays the eager step's logits."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapterserve.layers.parallel import SINGLE, TensorParallel
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
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
    }
    results = root / "results"
    results.mkdir()
    ranks = mp.start_processes(_rank_main, args=(world, root / "store", scenarios, results), nprocs=world,
                               join=False, start_method="spawn")
    deadline, exited = time.monotonic() + DEADLINE_S, False
    while not exited and time.monotonic() < deadline:
        exited = ranks.join(timeout=5)
    if not exited:
        for process in ranks.processes:
            process.kill()
    done = all((results / f"done.{rank}").exists() for rank in range(world))
    if not done:
        pytest.fail(f"the TP={world} ranks did not finish their steps in {DEADLINE_S} s (a hung collective?)")
    return {"world": world, "scenarios": scenarios, "results": results, "exited": exited}


def _rank_main(rank: int, world: int, store: Path, scenarios: dict, results: Path) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    tp = TensorParallel(rank, world, dist.group.WORLD)
    for name, (adapters, options) in scenarios.items():
        result = run_mixed_batch(MODEL, adapters, tp, device=f"cuda:{rank}", **options)
        torch.save(result.__dict__, results / f"{name}.{rank}.pt")
    torch.cuda.synchronize()
    (results / f"done.{rank}").touch()
    dist.destroy_process_group()  # the graphs are gone by now: a captured communicator may hang here otherwise


@pytest.mark.parametrize("name", ["mixed", "stacked"])
def test_tp_over_nccl_equals_tp1(setup, name):
    adapters, options = setup["scenarios"][name]
    want = run_mixed_batch(MODEL, adapters, SINGLE, device="cuda:0", **options)
    for rank in range(setup["world"]):
        got = torch.load(setup["results"] / f"{name}.{rank}.pt")
        for step, (g, w) in enumerate(zip(got["logits"], want.logits)):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}")
        torch.testing.assert_close(got["graph_logits"], got["logits"][1], atol=1e-4, rtol=0)
    torch.testing.assert_close(want.graph_logits, want.logits[1], atol=1e-4, rtol=0)


def test_ranks_exit_after_capturing_collectives(setup):
    """destroy_process_group returns once the graphs that captured its collectives are freed."""
    assert setup["exited"], "a rank hung in destroy_process_group after its steps"
