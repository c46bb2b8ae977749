"""Data parallelism through the server (issue 18): N engine replicas, one per GPU, behind
the real server (gRPC), on a Zipf workload over many rank-16 LoRA adapters uploaded
through the normal path. Tokens/s and the scaling factor against one replica, and adapter
affinity against Serve's power of two choices on the same request list: slot loads per
1,000 requests (each replica's own, from the metrics hub), tokens/s, TTFT p50/p99.

    PYTHONPATH=. python benchmarks/scale.py --smoke                  # CPU, tiny model, 1 and 2 replicas
    PYTHONPATH=. python benchmarks/scale.py --model 8b --replicas 1 --workdir /dev/shm/scale --out $OUT/scale.md
    PYTHONPATH=. python benchmarks/scale.py --model 8b --replicas 2 --routing adapter pow2 \\
        --workdir /dev/shm/scale --out $OUT/scale.md

--workdir keeps the checkpoint (random bfloat16 weights, written once), the adapter
directories, the server's store (adapters uploaded once) and every phase's results
(results.json): a later run on the same machine adds its phases, and the table printed last
holds every phase measured on this GPU, so one device call per phase group fits its time
limit. Each phase starts the application afresh (N replicas, the routing mode), uploads
what the store lacks, warms up with a request list of its own (same lengths), then runs
the timed list: `--requests-per-replica` x N requests through `--concurrency` x N streams
(closed loop). With as many streams as the replicas' batches hold, every replica is always
full and each request goes where one just finished, whatever the routing: the default
concurrency is 3/4 of the batch; `--concurrency 64` measures the saturated point.
At 1 replica the routing mode makes no difference: only "adapter" runs there.
--tp: the tensor-parallel section, benchmarks/tp_decode.py's own table (its arguments after
--tp-args, e.g. `--tp --tp-args --sizes 1,2,4`).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from adapterserve.server.serve_env import free_port, haproxy_ingress
from benchmarks.scale_load import Done, Job, run_load
from benchmarks.scale_workload import Request, adapter_name, write_adapters, zipf_requests

APP = "adapterserve"
ADAPTER_ROOM = 24 << 30  # adapter directories and the store's copies, at the default sizes
START = time.monotonic()
TP_SCRIPT = Path(__file__).with_name("tp_decode.py")


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {message}", flush=True)


def _checkpoint(model: str, device: str, workdir: Path) -> Path:
    """The backbone under workdir, written once (tiny: transformers' own; else random bfloat16)."""
    out = workdir / f"model-{model}"
    if (out / "config.json").is_file():
        return out
    _check_room(model, workdir)
    tmp = Path(tempfile.mkdtemp(prefix=f".model-{model}-", dir=workdir))
    if model == "tiny":
        from adapterserve.models.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(tmp, "llama")
    else:
        from benchmarks.checkpoints import SHAPES, write_random_checkpoint

        write_random_checkpoint(SHAPES[model], tmp, device)
    tmp.rename(out)
    return out


def _check_room(model: str, workdir: Path) -> None:
    """Exit with a message when workdir's file system cannot take the checkpoint and the adapters."""
    if model == "tiny":
        return
    from benchmarks.checkpoints import SHAPES

    need, free = SHAPES[model].checkpoint_bytes() + ADAPTER_ROOM, shutil.disk_usage(workdir).free
    if free < need:
        sys.exit(f"--workdir {workdir} has {free / 2**30:.0f} GiB free; the {model} checkpoint and the adapters "
                 f"need {need / 2**30:.0f} GiB: choose a larger file system (/dev/shm, /tmp)")


def _server_config(args, model_dir: Path, workdir: Path, replicas: int, routing: str) -> dict:
    gpu = args.device == "cuda"
    engine = {"device": args.device, "dtype": "bfloat16" if gpu else "float32", "max_num_seqs": args.batch,
              "max_loras": args.slots, "max_lora_rank": args.rank, "num_kv_blocks": args.kv_blocks,
              "max_model_len": args.prompt_max + args.max_tokens + 64}
    replica = {"num_replicas": replicas}
    if not gpu:
        replica["ray_actor_options"] = {"num_cpus": 0.1}  # several replicas on a few cores
    return {"model": str(model_dir), "model_id": f"scale-{args.model}", "encoder": False,
            "store": str(workdir / "store"), "engine": engine, "replica": replica,
            "ingress": {"num_replicas": args.ingress_replicas or replicas},
            "routing": {"mode": routing, "spill_queue_depth": args.spill_depth},
            "max_adapters_per_replica": args.adapters, "host_cache_bytes": args.host_cache_gib << 30,
            "metrics": {"push_interval_s": 0.5}, "drain_grace_s": 1.0}  # a phase ends with nothing running


def _upload_missing(target: str, dirs: dict[int, Path]) -> int:
    """Upload every adapter the store lacks (public, by name); returns how many were uploaded."""
    from adapterserve.clients.client import Client

    with Client(target, timeout=600) as client:
        stored = {a.ref.partition("@")[0] for a in client.list_adapters()}
        missing = [(adapter_name(i), path) for i, path in dirs.items() if adapter_name(i) not in stored]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda item: client.upload(item[1], item[0], public=True), missing))
    return len(missing)


def _by_replica(expected: int | None = None) -> dict[str, dict[str, float]]:
    """Each engine replica's totals from the hub; with `expected`, once their requests add up to it."""
    from ray import serve

    hub = serve.get_deployment_handle("MetricsHub", APP)
    deadline = time.monotonic() + 60
    while True:
        found = hub.by_replica.remote("model").result()
        counted = sum(v.get("adapterserve_request_queue_seconds_count", 0) for v in found.values())
        if expected is None or counted >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _jobs(requests: list[Request]) -> list[Job]:
    return [(i, adapter_name(r.adapter) if r.adapter is not None else None, r.prompt, r.max_tokens)
            for i, r in enumerate(requests)]


def _phase(args, model_dir: Path, workdir: Path, replicas: int, routing: str, timed: list[Request],
           warm: list[Request], dirs: dict[int, Path]) -> dict:
    from adapterserve.server import launch

    config = _server_config(args, model_dir, workdir, replicas, routing)
    began = time.monotonic()
    endpoints = launch.start(config, grpc_port=args.grpc_port, http_port=args.http_port)
    try:
        started = time.monotonic() - began
        log(f"{replicas} replica(s), routing {routing}: ready in {started:.1f} s; "
            f"uploaded {_upload_missing(endpoints.grpc, dirs)} adapters")
        concurrency = args.concurrency * replicas
        workers = args.clients or replicas
        run_load(endpoints.grpc, _jobs(warm), concurrency, workers)
        before = _by_replica(expected=len(warm))
        t0 = time.monotonic()
        done = run_load(endpoints.grpc, _jobs(timed), concurrency, workers)
        log(f"timed run: {len(done)} requests in {time.monotonic() - t0:.1f} s")
        after = _by_replica(expected=len(warm) + len(timed))
    finally:
        launch.stop(config)
    return {"replicas": replicas, "routing": routing, "concurrency": concurrency, "start_s": started,
            **_summary(done), **_replica_counts(before, after)}


def _summary(done: list[Done]) -> dict:
    wall = max(d.end for d in done) - min(d.start for d in done)
    ttft = sorted((d.first - d.start) * 1e3 for d in done)
    tokens = sum(d.tokens for d in done)
    return {"requests": len(done), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]}


def _replica_counts(before: dict, after: dict) -> dict:
    """Each replica's requests started and slot loads in the timed run (replicas sorted by requests)."""
    def delta(replica: str, key: str) -> int:
        return int(after[replica].get(key, 0) - before.get(replica, {}).get(key, 0))

    rows = sorted(((delta(r, "adapterserve_request_queue_seconds_count"), delta(r, "adapterserve_adapter_slot_loads"))
                   for r in after), reverse=True)
    served, loads = sum(r for r, _ in rows), sum(s for _, s in rows)
    return {"per_replica_requests": [r for r, _ in rows], "per_replica_loads": [s for _, s in rows],
            "slot_loads": loads, "loads_per_1k": 1000 * loads / served if served else float("nan")}


def _table(rows: list[dict]) -> list[str]:
    base = {r["model"]: r["tok_s"] for r in rows if r["replicas"] == 1 and r["routing"] == "adapter"}
    lines = ["| model | replicas | routing | requests | streams | tok/s | scaling | TTFT p50 ms | TTFT p99 ms "
             "| slot loads /1k req | requests per replica | slot loads per replica | start s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["replicas"], r["routing"])):
        scale = f"{r['tok_s'] / base[r['model']]:.2f}x" if r["model"] in base else "-"
        lines.append(f"| {r['model']} | {r['replicas']} | {r['routing']} | {r['requests']} | {r['concurrency']} "
                     f"| {r['tok_s']:,.0f} | {scale} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
                     f"| {r['loads_per_1k']:.1f} | {'/'.join(map(str, r['per_replica_requests']))} "
                     f"| {'/'.join(map(str, r['per_replica_loads']))} | {r['start_s']:.0f} |")
    return lines


def _tp_section(args) -> list[str]:
    """The tensor-parallel rows: benchmarks/tp_decode.py's own table."""
    if not TP_SCRIPT.is_file():
        return ["--tp: benchmarks/tp_decode.py is not in this tree"]
    done = subprocess.run([sys.executable, str(TP_SCRIPT), *args.tp_args], capture_output=True, text=True)
    return done.stdout.rstrip().splitlines()[-40:] + ([f"tp_decode.py failed: {done.stderr[-2000:]}"]
                                                       if done.returncode else [])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="8b", help="tiny, 1b or 8b (benchmarks/checkpoints.py shapes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--routing", nargs="+", choices=("adapter", "pow2"), default=["adapter", "pow2"])
    p.add_argument("--spill-depth", type=int, default=None, help="routing.spill_queue_depth (default: --batch)")
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,v_proj", help="LoRA target projections (PEFT's Llama default)")
    p.add_argument("--requests-per-replica", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=48,
                   help="streams per replica (default 3/4 of --batch: below saturation, where routing can choose)")
    p.add_argument("--batch", type=int, default=64, help="engine max_num_seqs")
    p.add_argument("--slots", type=int, default=64, help="engine max_loras")
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--host-cache-gib", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", type=int, default=None, help="client processes (default: one per replica)")
    p.add_argument("--ingress-replicas", type=int, default=None, help="default: one per engine replica")
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="kept between runs (default: a new temporary directory)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    p.add_argument("--tp", action="store_true", help="add the tensor-parallel section (tp_decode.py)")
    p.add_argument("--tp-args", nargs=argparse.REMAINDER, default=[], help="arguments for tp_decode.py (last)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 1 and 2 replicas, a few requests")
    p.add_argument("--report", action="store_true", help="print the table of --workdir's results; run nothing")
    return p


def _smoke(args) -> None:
    args.model, args.device, args.replicas = "tiny", "cpu", [1, 2]
    args.adapters, args.requests_per_replica, args.concurrency, args.batch, args.slots = 40, 16, 3, 4, 4
    args.kv_blocks, args.host_cache_gib, args.prompt_min, args.prompt_max, args.max_tokens = 128, 1, 4, 16, 6
    args.clients = 1
    args.tp_args = args.tp_args or ["--smoke"]


def main() -> None:
    args = _parser().parse_args()
    if args.smoke:
        _smoke(args)
    if args.device == "cpu":
        torch.set_num_threads(1)
    args.grpc_port, args.http_port = args.grpc_port or free_port(), free_port()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="adapterserve-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    if args.report:
        _report(args, workdir, gpu)
        return
    model_dir = _checkpoint(args.model, args.device, workdir)
    log(f"checkpoint {model_dir}")
    lists = {n: _request_lists(args, model_dir, n) for n in args.replicas}
    used = sorted({r.adapter for timed, warm in lists.values() for r in timed + warm})
    dirs = write_adapters(model_dir, workdir / "adapters", used, args.rank, tuple(args.targets.split(",")))
    log(f"{len(dirs)} adapters on disk (of {args.adapters}; the ones the requests use)")
    from adapterserve.server import launch

    try:
        for n in args.replicas:
            for routing in (["adapter"] if n == 1 else args.routing):
                row = _phase(args, model_dir, workdir, n, routing, *lists[n], dirs)
                _save(workdir, {**row, "model": args.model, "gpu": gpu})  # kept if a later phase is cut
    finally:
        launch.shutdown()
    _report(args, workdir, gpu)


def _request_lists(args, model_dir: Path, replicas: int) -> tuple[list[Request], list[Request]]:
    """(timed, warm-up) requests for a phase of `replicas`: the same for every routing mode."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    lengths = (args.prompt_min, args.prompt_max)
    timed = zipf_requests(args.requests_per_replica * replicas, args.adapters, args.zipf_alpha, lengths,
                          args.max_tokens, vocab, args.seed + replicas)
    warm = zipf_requests(args.concurrency * replicas, args.adapters, args.zipf_alpha, lengths, args.max_tokens,
                         vocab, args.seed + 1000 + replicas)
    return timed, warm


def _save(workdir: Path, row: dict) -> None:
    """Add `row` to workdir/results.json, in place of an earlier row of the same model, replicas and routing."""
    saved = workdir / "results.json"
    key = (row["model"], row["gpu"], row["replicas"], row["routing"])
    earlier = json.loads(saved.read_text()) if saved.is_file() else []
    kept = [r for r in earlier if (r["model"], r["gpu"], r["replicas"], r["routing"]) != key]
    saved.write_text(json.dumps([*kept, row], indent=1))


def _report(args, workdir: Path, gpu: str) -> None:
    saved = workdir / "results.json"
    here = [r for r in json.loads(saved.read_text()) if r["gpu"] == gpu] if saved.is_file() else []
    header = [f"\n{gpu}; {args.model}; Zipf alpha {args.zipf_alpha} over {args.adapters} rank-{args.rank} LoRAs "
              f"({args.targets}); prompts {args.prompt_min}-{args.prompt_max} tokens, {args.max_tokens} output tokens; "
              f"engine B={args.batch}, {args.slots} slots; spill depth {args.spill_depth or args.batch}; "
              f"gRPC through the server ({'HAProxy' if haproxy_ingress() else 'Serve proxy'} ingress); rows of "
              f"earlier runs in {workdir} included"]
    lines = header + _table(here) + (_tp_section(args) if args.tp else [])
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
