"""How long adding an adapter takes a tensor-parallel engine, by the way its parts reach the
workers (engine/tp/adapter_post.py): as shared-memory files ("file"), over the connections
("connection"), and, on a tree without adapter_post, the pickled part over the connection one
worker after another ("serial-pickle"). A random-weight backbone (each rank draws its shard),
N distinct rank-r LoRAs on all seven projections, added one by one (timed), then one request
of the last (its placement waits for the part to arrive). TP=1 is the floor: no transport.
"in share s": the adds' time in Lockstep.share (cutting, packing, sending; with adapter_post,
also waiting for each worker to have taken its previous part).

    python -m benchmarks.tp_adapter_post                           # CPU, gloo: hidden 2048, 8 layers, TP 1 and 2
    python -m benchmarks.tp_adapter_post --device cuda --shape 70b --sizes 4 --adapters 64
    python -m benchmarks.tp_adapter_post --shape deep --rank 64 --adapters 8   # CPU: 80 layers, 1,120 tensors a part
    python -m benchmarks.tp_adapter_post --smoke                   # the tiny shape, seconds
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from functools import partial
from pathlib import Path

from adapterserve import SamplingParams
from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.models.decoder_config import read_decoder_config
from benchmarks.checkpoints import ModelShape
from benchmarks.random_adapters import AdapterFactory
from benchmarks.tp_decode import ALL_SHAPES, random_shard

MID = ModelShape("mid", 2048, 8, 16, 8, 8192, 32000, tied=True)  # hidden 2048, 8 layers
DEEP = ModelShape("deep", 1024, 80, 8, 8, 4096, 32000, tied=True)  # the 70B's 80 layers: 1,120 tensors a part
SHAPES = {**ALL_SHAPES, "mid": MID, "deep": DEEP}
ROUTES = ("file", "connection")


def build_engine(shape_dir: Path, size: int, device: str, dtype: str, rank: int) -> Engine:
    config = EngineConfig(device=device, dtype=dtype, max_loras=2, max_lora_rank=rank, max_num_seqs=4,
                          max_num_batched_tokens=256, num_kv_blocks=64, warmup=False, tensor_parallel_size=size,
                          tensor_parallel_launch="local")
    build = partial(random_shard, str(shape_dir), config.torch_dtype, 0)
    return Engine.from_model(build, read_decoder_config(shape_dir), None, config)


def route_of(engine: Engine, route: str) -> str:
    """Point the engine's transport at the route; the route it takes."""
    lockstep = engine.lockstep
    if lockstep is None:
        return "none (TP=1)"
    if not hasattr(lockstep, "shared_dir"):
        return "serial-pickle"
    if route == "connection":
        lockstep.shared_dir = None
    elif lockstep.shared_dir is None:
        return "connection (no shared dir)"
    return route


def time_adds(engine: Engine, factory: AdapterFactory, count: int, rank: int) -> dict:
    """Seconds to add `count` adapters (and of that, in Lockstep.share: the parts' transport),
    and to serve one token of the last one after."""
    names = [f"lora{i}" for i in range(count)]
    adapters = [factory.lora(i, rank) for i in range(count)]
    shared = [0.0]
    if engine.lockstep is not None:
        engine.lockstep.share = _timed(engine.lockstep.share, shared)
    started = time.perf_counter()
    for name, adapter in zip(names, adapters):
        engine.add_adapter(name, adapter)
    added = time.perf_counter() - started
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0), [names[-1]])
    usable = time.perf_counter() - started
    lockstep = engine.lockstep
    sent = lockstep.adapter_bytes[1] if lockstep is not None else 0
    return {"add_s": added, "share_s": shared[0], "usable_s": usable, "per_ms": 1000 * added / count,
            "mb_per_part": sent / count / 1e6}


def _timed(share, total: list[float]):
    def timed(adapter) -> None:
        started = time.perf_counter()
        share(adapter)
        total[0] += time.perf_counter() - started
    return timed


def run(shape: ModelShape, sizes: list[int], routes: list[str], device: str, dtype: str, count: int,
        rank: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shape.hf_config().save_pretrained(tmp)
        factory = AdapterFactory(shape, device)  # drawn there, kept on the host
        for size in sizes:
            for route in (routes if size > 1 else ["-"]):
                engine = build_engine(Path(tmp), size, device, dtype, rank)
                try:
                    taken = route_of(engine, route)
                    rows.append({"tp": size, "route": taken, **time_adds(engine, factory, count, rank)})
                    print(f"  tp={size} {taken}: {rows[-1]['add_s']:.2f} s", flush=True)
                finally:
                    engine.close()
                    del engine
                    gc.collect()
    return rows


def table(rows: list[dict], shape: ModelShape, device: str, count: int, rank: int) -> str:
    lines = [(f"{count} rank-{rank} LoRAs (all 7 projections) added to a {shape.name} backbone "
              f"(hidden {shape.hidden}, {shape.layers} layers) on {device}"),
             (f"{'TP':>3} {'route':>28} {'add s':>8} {'in share s':>11} {'ms/adapter':>11} {'+1 token s':>11} "
              f"{'MB/part':>8}")]
    for r in rows:
        lines.append(f"{r['tp']:>3} {r['route']:>28} {r['add_s']:>8.2f} {r['share_s']:>11.2f} {r['per_ms']:>11.1f} "
                     f"{r['usable_s']:>11.2f} {r['mb_per_part']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--routes", default=",".join(ROUTES), help=f"of {ROUTES}, comma-separated")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--smoke", action="store_true", help="the tiny shape, 4 adapters of rank 4")
    args = p.parse_args(argv)
    shape, count, rank = (SHAPES["tiny"], 4, 4) if args.smoke else (SHAPES[args.shape], args.adapters, args.rank)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = run(shape, sizes, args.routes.split(","), args.device, args.dtype, count, rank)
    print(table(rows, shape, args.device, count, rank))


if __name__ == "__main__":
    main()
