"""What the server path adds: the same streamed requests through Ray Serve + gRPC
and through the in-process engine, on one machine, one after the other.

    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --device cuda
    PYTHONPATH=. python benchmarks/server_overhead.py --smoke          # CPU, tiny model
    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --no-inproc --relay-chunk-ms 0.2  # pacing

The server runs its engine in a child process of the replica (`engine_process: true`,
row "server"), and, unless --no-inproc, again inside the replica's process as before
the split (row "server-inproc"). On a CPU the in-process engine runs one thread, as the
replica's engine does (its Ray actor has one CPU).

Reports medians of time to first token, whole-request latency and the gap between
streamed chunks, for one request at a time (latency) and for a concurrent batch,
and the differences: the added latency per request and per streamed token.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from adapterserve.server.serve_env import free_port


def _checkpoint(model: str, device: str) -> Path:
    if model == "tiny":
        from adapterserve.models.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama")
    from benchmarks.checkpoints import SHAPES, scratch_dir, write_random_checkpoint

    shape = SHAPES[model]
    return write_random_checkpoint(shape, scratch_dir(shape.checkpoint_bytes()), device)


async def _timed(stream) -> tuple[float, float, list[float]]:
    """(first-chunk s, total s, gaps between chunks s) of one streamed request."""
    start = last = time.perf_counter()
    first, gaps = None, []
    async for _chunk in stream:
        now = time.perf_counter()
        if first is None:
            first = now - start
        else:
            gaps.append(now - last)
        last = now
    return first, last - start, gaps


async def _workload(open_stream, prompts: list[list[int]], concurrency: int) -> dict[str, float]:
    results = []
    for i in range(0, len(prompts), concurrency):
        group = prompts[i : i + concurrency]
        results += await asyncio.gather(*[_timed(open_stream(p)) for p in group])
    gaps = [g for _, _, gs in results for g in gs]
    return {"ttft": statistics.median(r[0] for r in results) * 1e3,
            "total": statistics.median(r[1] for r in results) * 1e3,
            "gap": statistics.median(gaps) * 1e3}


def _engine_rows(path: Path, engine_cfg: dict, prompts, max_tokens: int, batches: list[int]) -> dict:
    from adapterserve import Engine, SamplingParams

    engine = Engine.from_pretrained(path, **engine_cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def run(concurrency: int):
        await _workload(lambda p: engine.stream(p, params), prompts[:concurrency], concurrency)  # warm-up
        return await _workload(lambda p: engine.stream(p, params), prompts, concurrency)

    rows = {c: asyncio.run(run(c)) for c in batches}
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def _server_rows(path: Path, engine_cfg: dict, prompts, max_tokens: int, batches: list[int],
                 engine_process: bool, relay_chunk_ms: float) -> dict:
    import ray

    from adapterserve.clients.client import AsyncClient
    from adapterserve.server import launch

    config = {"model": str(path), "engine": engine_cfg, "encoder": False, "store": tempfile.mkdtemp(),
              "engine_process": engine_process, "relay_chunk_ms": relay_chunk_ms,
              "replica": {"max_ongoing_requests": 512, "max_queued_requests": 1024}}
    endpoints = launch.start(config, grpc_port=free_port(), http_port=free_port())
    try:
        async def run(concurrency: int):
            async with AsyncClient(endpoints.grpc, timeout=600) as client:
                def stream(p):
                    return client.stream(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                await _workload(stream, prompts[:concurrency], concurrency)  # warm-up
                return await _workload(stream, prompts, concurrency)

        return {c: asyncio.run(run(c)) for c in batches}
    finally:
        launch.stop(config)
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no-inproc", action="store_true", help="skip the server with the engine in the replica")
    parser.add_argument("--relay-chunk-ms", type=float, default=0.5, help="the server's chunk pacing (relay.py)")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.device, args.requests, args.max_tokens = "tiny", "cpu", 8, 8
    if args.device == "cpu":
        torch.set_num_threads(1)  # the replica's engine gets one thread (its actor has one CPU): the same here
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine_cfg = {"device": args.device, "dtype": dtype, "max_num_seqs": 64, "num_kv_blocks": 2048,
                  "max_model_len": 1024}
    path = _checkpoint(args.model, args.device)
    vocab = 500 if args.model == "tiny" else 32000
    prompts = [torch.randint(3, vocab, (256 if args.model != "tiny" else 16,)).tolist() for _ in range(args.requests)]
    batches = [1, min(16, args.requests)]
    paths = {"engine": _engine_rows(path, engine_cfg, prompts[: max(batches) * 2], args.max_tokens, batches)}
    for label, own_process in (("server", True), ("server-inproc", False)):
        if own_process or not args.no_inproc:
            paths[label] = _server_rows(path, engine_cfg, prompts[: max(batches) * 2], args.max_tokens, batches,
                                        own_process, args.relay_chunk_ms)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{name}; {args.model}; {args.max_tokens} output tokens; relay_chunk_ms {args.relay_chunk_ms}; medians in ms")
    _report(paths, batches)


def _report(paths: dict[str, dict], batches: list[int]) -> None:
    print(f"{'path':<15}{'conc':>5}{'ttft':>9}{'total':>10}{'gap':>8}")
    for label, rows in paths.items():
        for c, r in rows.items():
            print(f"{label:<15}{c:>5}{r['ttft']:>9.2f}{r['total']:>10.2f}{r['gap']:>8.3f}")
    local = paths["engine"]
    for label, served in paths.items():
        if label == "engine":
            continue
        for c in batches:
            added = served[c]["total"] - local[c]["total"]
            per_token = served[c]["gap"] - local[c]["gap"]
            print(f"{label}, concurrency {c}: adds {served[c]['ttft'] - local[c]['ttft']:.2f} ms to first token, "
                  f"{added:.2f} ms per request, {per_token:.3f} ms per streamed token (targets < 2 ms, < 0.5 ms)")

if __name__ == "__main__":
    main()
