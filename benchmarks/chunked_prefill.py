"""Prefill under a step budget: time to first token and prefill step time when prompts run
whole against when they run in chunks (chunked prefill), side by side on one backbone.

    PYTHONPATH=. python3 benchmarks/chunked_prefill.py --model 8b      # GPU
    PYTHONPATH=. python3 benchmarks/chunked_prefill.py --smoke         # CPU, tiny model

Each case (a set of prompts under one `max_num_batched_tokens`) runs three times on a
fresh engine: the first run includes whatever Triton compiles for its shapes; the
table reports the first run's TTFT apart, and the median of the later two for the
rest. Prompts are token ids, greedy, 8 output tokens, no adapters.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from adapterserve.config import EngineConfig
from adapterserve.models.loader import load_decoder
from benchmarks.backbone import Backbone
from benchmarks.checkpoints import SHAPES, scratch_dir, write_random_checkpoint
from benchmarks.measure import StepTrace, run_requests, sync
from benchmarks.workloads import make_prompts

MAX_TOKENS = 8


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, int]  # prompt lengths drawn from this range
    batch: int
    budgets: tuple[int, ...]  # max_num_batched_tokens: the first holds every prompt whole


def cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("mixed", (8, 40), 4, (512, 16)), Case("one long", (200, 200), 1, (512, 32))]
    return [Case("64 x 128-1024", (128, 1024), 64, (65536, 8192, 2048)),
            Case("1 x 6000", (6000, 6000), 1, (8192, 2048, 512))]


def run_case(backbone: Backbone, case: Case, budget: int, device: str, dtype: str, vocab: int) -> dict:
    prompts = make_prompts(case.batch, vocab, case.lengths, seed=7)
    tokens = sum(len(p) for p in prompts) + case.batch * (MAX_TOKENS + 16)
    config = EngineConfig(device=device, dtype=dtype, max_loras=1, max_lora_rank=16, block_size=16,
                          num_kv_blocks=-(-tokens // 16) + 8, max_num_seqs=case.batch,
                          max_num_batched_tokens=budget, max_model_len=8192)
    engine = backbone.engine(config)
    try:
        trace = StepTrace(engine)
        runs = []
        for _ in range(3):
            sync(device)
            runs.append(run_requests(engine, trace, prompts, [None] * case.batch, [MAX_TOKENS] * case.batch))
        return _row(case, budget, runs)
    finally:
        engine = None
        backbone.reset()


def _row(case: Case, budget: int, runs: list) -> dict:
    def prefill_ms(run) -> list[float]:
        return [1e3 * s.seconds for s in run.steps if not s.decode]

    warm = runs[1:]
    return {
        "case": case.name, "budget": budget,
        "first_ttft_ms": 1e3 * statistics.median(runs[0].ttft),
        "ttft_ms": statistics.median(1e3 * statistics.median(r.ttft) for r in warm),
        "max_ttft_ms": statistics.median(1e3 * max(r.ttft) for r in warm),
        "prefill_steps": len(prefill_ms(warm[0])),
        "prefill_step_ms": statistics.median(statistics.mean(prefill_ms(r)) for r in warm),
        "prefill_ms": statistics.median(sum(prefill_ms(r)) for r in warm),
    }


def print_table(rows: list[dict], device: str, model: str) -> None:
    print(f"\n{device}; {model}; greedy, {MAX_TOKENS} output tokens; warm = median of runs 2-3")
    print("| prompts | max_num_batched_tokens | TTFT first run ms | TTFT median ms | TTFT max ms "
          "| prefill steps | ms per prefill step | prefill ms | vs whole |")
    print("|---|---|---|---|---|---|---|---|---|")
    whole: dict[str, float] = {}
    for r in rows:
        whole.setdefault(r["case"], r["prefill_ms"])
        ratio = r["prefill_ms"] / whole[r["case"]]
        print(f"| {r['case']} | {r['budget']} | {r['first_ttft_ms']:.1f} | {r['ttft_ms']:.1f} | {r['max_ttft_ms']:.1f} "
              f"| {r['prefill_steps']} | {r['prefill_step_ms']:.2f} | {r['prefill_ms']:.1f} | {ratio:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="8b", choices=["1b", "8b"])
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, tiny model")
    args = parser.parse_args()
    name, device, dtype = ("tiny", "cpu", "float32") if args.smoke else (args.model, "cuda", "bfloat16")
    shape = SHAPES[name]
    tmp = scratch_dir(shape.checkpoint_bytes())
    started = time.perf_counter()
    ckpt = write_random_checkpoint(shape, tmp / "model", device)
    model, _ = load_decoder(ckpt, torch.bfloat16 if dtype == "bfloat16" else torch.float32, device, max_positions=8192)
    backbone = Backbone(model)
    rows = [run_case(backbone, case, budget, device, dtype, shape.vocab)
            for case in cases(args.smoke) for budget in case.budgets]
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print_table(rows, card, f"{name} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
