"""n > 1: one request of n choices against n requests of one, side by side on one backbone.

    PYTHONPATH=. python3 benchmarks/n_choices.py --model 1b      # GPU
    PYTHONPATH=. python3 benchmarks/n_choices.py --smoke         # CPU, tiny model, seconds

Requests of a 1,000-token prompt (each its own), 4 choices of 128 sampled tokens (seeded,
ignore_eos), 16 such requests at once: as 16 requests of n = 4, and as 64 requests of n = 1
(choice i's seed), with the prefix cache off and on. Every case runs on a fresh engine after
a warm-up of the same lengths on other prompts. TTFT: add_request to the step that returns
the request's first token (n = 4: any choice's; n = 1: each request's); tokens/s: generated
tokens over the run's wall time; peak KV blocks: the most blocks held at once (from the
block manager); prompt tokens computed: the tokens of prompts the steps computed (fork
recomputes of a prompt's last token included).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.engine.sampling_params import SamplingParams
from benchmarks.backbone import Backbone, add_model_arguments, model_target, random_backbone
from benchmarks.measure import sync


@dataclass(frozen=True)
class Workload:
    requests: int
    n: int
    prompt_tokens: int
    answer_tokens: int


FULL = Workload(16, 4, 1000, 128)
SMOKE = Workload(3, 3, 40, 6)


@dataclass
class Result:
    ttft: list[float]
    tokens: int
    wall: float
    peak_blocks: int
    computed: int  # tokens the steps computed


def _prompts(work: Workload, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(work.prompt_tokens)] for _ in range(work.requests)]


def _sampling(work: Workload, n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=work.answer_tokens, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True, n=n)


def run(engine: Engine, work: Workload, prompts: list[list[int]], together: bool) -> Result:
    """Every request added at once; step until all are done."""
    added: dict[str, float] = {}
    requests = []
    start = time.perf_counter()
    for k, prompt in enumerate(prompts):
        specs = [(work.n, 10 * k)] if together else [(1, 10 * k + i) for i in range(work.n)]
        for n, seed in specs:
            request = engine.add_request(prompt, _sampling(work, n, seed))
            requests.append(request)
            added[request.request_id] = time.perf_counter()
    result = Result([], 0, 0.0, 0, 0)
    before = engine.stats.snapshot().batch_tokens.sum
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        result.peak_blocks = max(result.peak_blocks, engine.blocks.num_blocks - engine.blocks.num_free)
        for out in outputs:
            if out.request_id in added and out.token_ids:
                result.ttft.append(now - added.pop(out.request_id))
    while engine._in_flight is not None:
        engine.step()
    result.wall = time.perf_counter() - start
    result.tokens = sum(len(c.output_ids) for r in requests for c in r.all_choices)
    result.computed = int(engine.stats.snapshot().batch_tokens.sum - before)
    return result


def case(backbone: Backbone, work: Workload, together: bool, caching: bool, device: str, dtype: str,
         vocab: int) -> Result:
    sequences = work.requests * work.n
    longest = work.prompt_tokens + work.answer_tokens
    config = EngineConfig(device=device, dtype=dtype, block_size=16, num_kv_blocks=sequences * -(-longest // 16) + 64,
                          max_num_seqs=sequences, max_num_batched_tokens=8192, max_model_len=longest + 16,
                          enable_prefix_caching=caching)
    engine = backbone.engine(config)
    try:
        run(engine, work, _prompts(work, 100, vocab), together)  # warm-up: the same lengths, other prompts
        engine.blocks.forget_idle()  # no hit from the warm-up
        sync(device)
        return run(engine, work, _prompts(work, 1, vocab), together)
    finally:
        engine = None
        backbone.reset()


def print_table(rows: list[tuple[str, Result]], card: str, model: str, work: Workload) -> None:
    print(f"\n{card}; {model}; {work.requests} prompts of {work.prompt_tokens} tokens, {work.n} choices of "
          f"{work.answer_tokens} sampled tokens each, all at once")
    print("| case | TTFT p50 ms | TTFT max ms | tokens/s | peak KV blocks | tokens computed "
          "| tokens/s vs separate, cache off | peak blocks vs separate, cache off |")
    print("|---|---|---|---|---|---|---|---|")
    base = next(r for name, r in rows if name.startswith("separate") and "off" in name)
    for name, r in rows:
        rate = r.tokens / r.wall
        print(f"| {name} | {1e3 * statistics.median(r.ttft):.1f} | {1e3 * max(r.ttft):.1f} | {rate:.0f} "
              f"| {r.peak_blocks} | {r.computed} | {rate / (base.tokens / base.wall):.2f}x "
              f"| {r.peak_blocks / base.peak_blocks:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args()
    name, device, dtype = model_target(args)
    work = SMOKE if args.smoke else FULL
    started = time.perf_counter()
    backbone, shape = random_backbone(name, device, dtype)
    cases = (("separate requests, cache off", False, False), ("separate requests, cache on", False, True),
             (f"n = {work.n}, cache off", True, False), (f"n = {work.n}, cache on", True, True))
    rows = [(label, case(backbone, work, together, caching, device, dtype, shape.vocab))
            for label, together, caching in cases]
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print_table(rows, card, f"{name} ({time.perf_counter() - started:.0f} s)", work)


if __name__ == "__main__":
    main()
