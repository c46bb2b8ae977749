"""Engine throughput (issue 7): decode step time, tokens/s, TTFT, adapter tax and the
ratio to the memory floor, for random-weight Llama-shaped 1B / 8B checkpoints in
bfloat16, against transformers and transformers + PEFT on the same prompts.

Run on a GPU (one table at the end, naming the GPU; markdown at --out, JSON beside it):
    PYTHONPATH=. python3 benchmarks/engine_throughput.py --models 1b --out $OUT/engine_throughput.md
    PYTHONPATH=. python3 benchmarks/engine_throughput.py --models 8b --out $OUT/engine_throughput_8b.md
Every path on the CPU (tiny model, float32, a few steps):
    PYTHONPATH=. python3 benchmarks/engine_throughput.py --smoke --out /tmp/et.md
--dtype fp8 runs the backbone with float8 linear weights (layers.base_gemm; --fp8-gemm picks
the kernel); its floor counts those weights at one byte (embeddings, lm_head and the KV
cache stay bfloat16); the transformers baselines stay bfloat16.
--first-request adds the TTFT of the first request after the engine is ready against the
steady state (the engine's own warm-up is all it gets), and every row the engine's start-up.
Each workload's timed run follows a warm-up over every decode bucket and the timed prompts; a row
whose timed run still compiled a kernel variant or captured a graph says so in its note.
--no-engine-warmup skips the engines' own warm-up (this benchmark's still runs).
benchmarks/README.md says what each column means.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from adapterserve.config import FP8_GEMMS, EngineConfig
from adapterserve.models.loader import load_decoder
from benchmarks import report
from benchmarks.backbone import Backbone
from benchmarks.checkpoints import SHAPES, scratch_dir, write_random_checkpoint
from benchmarks.first_request import cold_cost_lines, first_request_line, measure_first_request
from benchmarks.hf_baseline import add_peft_loras, load_hf, timed_row
from benchmarks.hotswap import measure_hotswap
from benchmarks.measure import Floor, copy_bandwidth, floor_for
from benchmarks.random_adapters import (
    AdapterFactory,
    decode_read_bytes,
    write_peft_lora,
)
from benchmarks.workloads import (
    EXTRA_WORKLOADS,
    VARIANTS,
    WORKLOADS,
    Settings,
    make_prompts,
    plan,
    run_workload,
    supports_bottleneck,
)

START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {message}", flush=True)


@dataclass(frozen=True)
class Config:
    settings: Settings
    models: tuple[str, ...]
    batches: dict[str, tuple[int, ...]]
    workloads: tuple[str, ...]
    hf_models: tuple[str, ...]
    hf_batch: int
    hf_tokens: int
    copy_bytes: int
    budget_s: float
    out: Path
    first_request: bool = False
    hotswap: bool = True


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b", help="comma list of 1b, 8b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "fp8"], help="the engine's dtype")
    p.add_argument("--fp8-gemm", default="auto", choices=FP8_GEMMS, help="with --dtype fp8: the base product's "
                   "kernel (layers.base_gemm)")
    p.add_argument("--batches", default="1,16,64,256", help="batch sizes for 1b")
    p.add_argument("--batches-8b", default="64", help="batch sizes for 8b")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="engine token budget per step")
    p.add_argument("--zipf-adapters", type=int, default=1000)
    p.add_argument("--zipf-slots", type=int, default=128)
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--hf-models", default="1b", help="models that also run transformers (+PEFT); '' for none")
    p.add_argument("--hf-batch", type=int, default=64, help="batch (and PEFT adapters) of the baselines")
    p.add_argument("--hf-tokens", type=int, default=8, help="decode steps of the baselines")
    p.add_argument("--budget-s", type=float, default=420, help="start no new task after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("engine_throughput.md"))
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny model, few steps: checks every path")
    p.add_argument("--first-request", action="store_true", help="also: TTFT of the first request after the "
                   "engine is ready against the steady state, and the engine's start-up (warm-up) time")
    p.add_argument("--no-hotswap", dest="hotswap", action="store_false", help="skip the hot-swap measurement "
                   "(after each model's first batch)")
    p.add_argument("--no-engine-warmup", dest="engine_warmup", action="store_false", help="workload engines skip "
                   "their own warm-up (this benchmark's, over every bucket and the timed prompts, still runs): "
                   "tens of seconds less per workload; a row whose timed run then compiled or captured anything "
                   "says so in its note")
    a = p.parse_args(argv)
    unknown = {w for w in split(a.workloads) if _base_workload(w) not in WORKLOADS + EXTRA_WORKLOADS}
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS + EXTRA_WORKLOADS)}, "
                f"each optionally with a variant suffix ({', '.join(VARIANTS)})")
    if a.smoke:
        dtype = "fp8" if a.dtype == "fp8" else "float32"
        settings = Settings("cpu", dtype, 6, (8, 24), 16, 48, 40, 6, a.zipf_alpha, a.seed, a.fp8_gemm,
                            a.engine_warmup)
        return Config(settings, ("tiny",), {"tiny": (1, 4)}, split(a.workloads), ("tiny",), 4, 2, 8 << 20,
                      a.budget_s, a.out, a.first_request, a.hotswap)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --smoke for the CPU check")
    settings = Settings("cuda", a.dtype, a.max_tokens, (a.prompt_min, a.prompt_max), 16, a.max_batched_tokens,
                        a.zipf_adapters, a.zipf_slots, a.zipf_alpha, a.seed, a.fp8_gemm, a.engine_warmup)
    return Config(settings, split(a.models), {"1b": ints(a.batches), "8b": ints(a.batches_8b)}, split(a.workloads),
                  split(a.hf_models), a.hf_batch, a.hf_tokens, 1 << 30, a.budget_s, a.out, a.first_request,
                  a.hotswap)


def _activations(s: Settings) -> torch.dtype:
    """The activations' dtype (fp8 runs bfloat16 activations on a GPU, float32 on the CPU)."""
    return EngineConfig(device=s.device, dtype=s.dtype).torch_dtype


def split(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in split(text))


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"


def expired(cfg: Config) -> bool:
    return time.monotonic() - START > cfg.budget_s


def batch_order(batches: tuple[int, ...], first: int) -> list[int]:
    """The baselines' batch first (the issue's targets are there), then ascending."""
    return sorted(batches, key=lambda b: (b != first, b))


def guarded(what: str, fn, *args):
    """Run one task and return its result; an exception becomes an error entry
    ({"error": ...}), its traceback printed."""
    try:
        return fn(*args)
    except Exception as exc:  # one failure must not stop the rest
        traceback.print_exc(file=sys.stdout)
        log(f"FAILED {what}: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {str(exc)[:60]}"}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_model(name: str, cfg: Config, bandwidth: float, rows: list[dict], hotswaps: dict[str, dict],
              firsts: dict[str, dict]) -> None:
    s, shape = cfg.settings, SHAPES[name]
    tmp = scratch_dir(shape.checkpoint_bytes())
    try:
        log(f"{name}: writing a random bf16 checkpoint ({shape.checkpoint_bytes() / 2**30:.1f} GiB) to {tmp}")
        ckpt = write_random_checkpoint(shape, tmp / "model", s.device)
        peft_dir = guarded(f"{name} PEFT files", write_peft_lora, shape, tmp / "peft-lora", s.device)
        log(f"{name}: loading it into the engine's decoder")
        fp8_gemm = s.fp8_gemm if s.dtype == "fp8" else None
        model, _ = load_decoder(ckpt, _activations(s), s.device, max_positions=8192, fp8_gemm=fp8_gemm)
        backbone = Backbone(model)
        factory = AdapterFactory(shape, s.device, seed=s.seed)
        bottleneck = supports_bottleneck(backbone, s)
        log(f"{name}: bottleneck adapters in the engine: {'yes' if bottleneck else 'no (skipped in families)'}")
        if cfg.first_request:  # before anything else compiles: the engine's own warm-up is all it gets
            log(f"{name}: first request after ready")
            firsts[name] = guarded(f"{name} first request", measure_first_request, backbone, factory, s)
            log(first_request_line(name, firsts[name]))
            for line in cold_cost_lines(firsts[name]):
                log(line)
        order = batch_order(cfg.batches[name], cfg.hf_batch)
        for batch in order:
            _run_batch(name, batch, backbone, factory, peft_dir, bottleneck, cfg, bandwidth, rows)
            if batch == order[0] and cfg.hotswap:
                _run_hotswap(name, backbone, factory, cfg, hotswaps)
            if batch == order[0] and name in cfg.hf_models:  # with or without the hot-swap run
                lora_bytes = decode_read_bytes(factory.lora(0), model.embed_tokens.weight.element_size())
                floor = floor_for(model, {f"a{i}": lora_bytes for i in range(cfg.hf_batch)}, bandwidth)
                _run_hf(name, ckpt, cfg, rows, floor)
        model = backbone = None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_batch(name: str, batch: int, backbone: Backbone, factory: AdapterFactory, peft_dir: Path | dict,
               bottleneck: bool, cfg: Config, bandwidth: float, rows: list[dict]) -> None:
    s = cfg.settings
    prompts = make_prompts(batch, backbone.model.cfg.vocab_size, s.prompt_range, s.seed + batch)

    def one(workload: str) -> dict:
        return run_workload(backbone, plan(workload, batch, factory, peft_dir, s, bottleneck), prompts, s, bandwidth)

    for workload in cfg.workloads:
        key = {"model": name, "workload": workload, "batch": batch}
        if expired(cfg):
            rows.append({**key, "error": "skipped: time budget"})
            continue
        log(f"{name} B={batch} {workload}: running")
        rows.append({**key, **guarded(f"{name} B={batch} {workload}", one, workload)})
        log(f"{name} B={batch} {workload}: " + report.text_table([rows[-1]]).splitlines()[-1])


def _start_lines(rows: list[dict]) -> list[str]:
    """Engine start-up (construction, of which its warm-up) per model: the range over workloads."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        starts = [r["start_s"] for r in rows if r["model"] == model and "start_s" in r]
        warm = [r["warmup_s"] for r in rows if r["model"] == model and r.get("warmup_s") is not None]
        if starts:
            of = f", of which warm-up {min(warm):.1f}-{max(warm):.1f} s" if warm else ", no warm-up"
            lines.append(f"{model} engine start-up {min(starts):.1f}-{max(starts):.1f} s per workload{of} "
                         "(the first includes compiling; later ones load Triton's cache)")
    return lines


def _base_workload(name: str) -> str:
    """The workload without its variant suffixes (any number, any order)."""
    while (suffix := next((v for v in VARIANTS if name.endswith(v)), None)) is not None:
        name = name.removesuffix(suffix)
    return name


def _run_hotswap(name: str, backbone: Backbone, factory: AdapterFactory, cfg: Config,
                 hotswaps: dict[str, dict]) -> None:
    if expired(cfg):
        hotswaps[name] = {"error": "skipped: time budget"}
        return
    log(f"{name}: hot-swap")
    batch = min(cfg.hf_batch, 64)
    hotswaps[name] = guarded(f"{name} hot-swap", measure_hotswap, backbone, factory, cfg.settings, batch)
    log(report.hotswap_line(name, hotswaps[name]))


def _run_hf(name: str, ckpt: Path, cfg: Config, rows: list[dict], floor: Floor) -> None:
    """transformers alone, then + PEFT (one LoRA per request), on the same prompts."""
    s, batch = cfg.settings, cfg.hf_batch
    prompts = make_prompts(batch, SHAPES[name].vocab, s.prompt_range, s.seed + batch)
    names = [f"a{i}" for i in range(batch)]
    context = sum(len(p) for p in prompts) + batch * (1 + cfg.hf_tokens // 2)  # mid-decode, no padding
    holder: dict = {}

    def with_floor(row: dict, adapters: frozenset[str]) -> dict:
        floor_s = floor.seconds(context, adapters)
        return {**row, "floor_ms": 1e3 * floor_s, "x_floor": row["decode_ms"] / (1e3 * floor_s)}

    def base() -> dict:
        holder["model"] = load_hf(ckpt, _activations(s), s.device)
        return with_floor(timed_row(holder["model"], prompts, cfg.hf_tokens, s.device), frozenset())

    def peft() -> dict:
        log(f"{name}: adding {batch} PEFT LoRAs")
        start = time.monotonic()
        model = add_peft_loras(holder.pop("model"), batch, log=log)
        added = time.monotonic() - start
        row = with_floor(timed_row(model, prompts, cfg.hf_tokens, s.device, adapter_names=names), frozenset(names))
        return {**row, "setup_s": added, "note": f"{batch} LoRAs r16 (added in {added:.0f} s), "
                                                 f"{cfg.hf_tokens} decode steps"}

    for workload, fn in (("hf", base), ("hf+peft", peft)):
        key = {"model": name, "workload": workload, "batch": batch}
        if expired(cfg) or (workload == "hf+peft" and "model" not in holder):
            rows.append({**key, "error": "skipped: time budget" if expired(cfg) else "skipped: no hf model"})
            continue
        log(f"{name} B={batch} {workload}: running")
        rows.append({**key, **guarded(f"{name} {workload}", fn)})
        log(f"{name} B={batch} {workload}: " + report.text_table([rows[-1]]).splitlines()[-1])
    holder.clear()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    s = cfg.settings
    gpu = device_name(s.device)
    log(f"device: {gpu}; models {', '.join(cfg.models)}; workloads {', '.join(cfg.workloads)}")
    bandwidth = copy_bandwidth(s.device, cfg.copy_bytes)
    log(f"device-to-device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows: list[dict] = []
    hotswaps: dict[str, dict] = {}
    firsts: dict[str, dict] = {}
    for name in cfg.models:
        try:
            run_model(name, cfg, bandwidth, rows, hotswaps, firsts)
        except Exception:  # a checkpoint that cannot be written or loaded: the other model still runs
            traceback.print_exc(file=sys.stdout)
            rows.append({"model": name, "workload": "setup", "batch": 0, "error": "setup failed (see log)"})
    report.add_taxes(rows)
    rows.sort(key=lambda r: (cfg.models.index(r["model"]), r["batch"]))
    header = [
        (f"{gpu}; {datetime.date.today()}; torch {torch.__version__}; {s.dtype}; copy bandwidth "
         f"{bandwidth / 1e9:.0f} GB/s (read+write)"),
        (f"prompts {s.prompt_range[0]}-{s.prompt_range[1]} random tokens, {s.max_tokens} greedy output tokens "
         f"(ignore_eos); LoRA rank 16 on q,k,v,o,gate,up,down unless stated; token budget "
         f"{s.max_batched_tokens}/step; zipf alpha {s.zipf_alpha} over {s.zipf_adapters} adapters, "
         f"{s.zipf_slots} slots"),
    ]
    extra = ([report.hotswap_line(m, h) for m, h in hotswaps.items()] + report.ratio_lines(rows, cfg.hf_batch)
             + report.target_lines(rows, hotswaps) + [first_request_line(m, f) for m, f in firsts.items()]
             + _start_lines(rows))
    raw = {"device": gpu, "date": str(datetime.date.today()), "bandwidth": bandwidth, "settings": asdict(s),
           "config": {k: v for k, v in asdict(cfg).items() if k != "settings"}, "rows": rows, "hotswap": hotswaps,
           "first_request": firsts}
    report.write_outputs(cfg.out, header, rows, extra, raw)
    print("\n".join(["", "=" * 40, *header, "", report.text_table(rows), "", *extra,
                     f"written: {cfg.out} and {cfg.out.with_suffix('.json')}; "
                     f"total {time.monotonic() - START:.0f} s"]), flush=True)


if __name__ == "__main__":
    main()
