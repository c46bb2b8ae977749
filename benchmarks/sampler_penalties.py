"""What logit bias and penalties cost a decode step, and why their state lives on the device.

    PYTHONPATH=. python benchmarks/sampler_penalties.py            # sampler alone, ~1 min
    PYTHONPATH=. python benchmarks/sampler_penalties.py --engine 1b  # also whole decode steps

Sampler alone (Llama-3 vocabulary, 1,024-token prompts): per step, the host's time to
issue the work and the GPU's time to run it, for
  - off:         no row uses bias or penalties (the sampler as before);
  - bias:        300 logit_bias entries per row;
  - tables:      presence + frequency + repetition penalties with per-request device tables
                 (engine/penalties.py: the newest token counted on the device);
  - host lists:  the same penalties rebuilt each step from the requests' token lists
                 (prompt + output ids uploaded and scattered into fresh count tables).
With --engine, median ms of an overlapped engine step (decode, base model, greedy)
with the sampling above. Prints one table naming the GPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.engine.host_copy import to_device
from adapterserve.engine.penalties import PenaltyState, StepPenalties
from adapterserve.engine.request import Request
from adapterserve.engine.sampler import sample
from benchmarks.checkpoints import SHAPES, scratch_dir, write_random_checkpoint

VOCAB = 128256
PROMPT = 1024
PENALTIES = {"presence_penalty": 0.3, "frequency_penalty": 0.3, "repetition_penalty": 1.1}
BIAS = {i * 7: 1.0 for i in range(300)}


def _requests(batch: int, outputs: int, fields: dict) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=outputs + 64, **fields)
    requests = []
    for _ in range(batch):
        r = Request(prompt_ids=np.random.randint(0, VOCAB, PROMPT).tolist(), sampling=params)
        r.output_ids = np.random.randint(0, VOCAB, outputs).tolist()
        requests.append(r)
    return requests


def _host_lists(requests: list[Request], logits: torch.Tensor) -> StepPenalties:
    """The alternative: count tables rebuilt from host token lists every step."""
    dev, n = logits.device, len(requests)
    fresh = PenaltyState(VOCAB, dev).penalties
    fresh.assign(requests)
    for name, ids_of in (("counts", lambda r: r.output_ids), ("in_prompt", lambda r: r.prompt_ids)):
        lists = [ids_of(r) for r in requests]
        rows = np.repeat(np.arange(n), [len(ids) for ids in lists])
        tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in lists])
        table, index = fresh[name], (to_device(rows, dev, torch.long), to_device(tokens, dev, torch.long))
        table.index_put_(index, torch.ones((), dtype=table.dtype, device=dev), accumulate=table.dtype != torch.bool)
    params = [[r.sampling.repetition_penalty, r.sampling.frequency_penalty, r.sampling.presence_penalty]
              for r in requests]
    fresh["params"][:n].copy_(to_device(params, dev, torch.float32))
    rows = to_device(list(range(n)), dev, torch.long)
    return StepPenalties(rows=rows, table_rows=rows, penalties=fresh, in_use=(True, True, True))


def _sampler_step(kind: str, requests: list[Request], logits: torch.Tensor, state: PenaltyState,
                  gen: torch.Generator) -> None:
    params = [r.sampling for r in requests]
    generators = [None] * len(requests)
    if kind == "host lists":
        sample(logits, params, generators, gen, _host_lists(requests, logits))
        return
    penalties = state.prepare(requests)
    tokens = sample(logits, params, generators, gen, penalties)
    state.record(penalties, tokens)


def time_sampler(kind: str, batch: int, outputs: int, steps: int = 20) -> tuple[float, float]:
    """(host ms, GPU ms) per step, medians."""
    fields = {"off": {}, "bias": {"logit_bias": BIAS}}.get(kind, PENALTIES)
    requests = _requests(batch, outputs, fields)
    logits = torch.randn(batch, VOCAB, device="cuda")
    state, gen = PenaltyState(VOCAB, torch.device("cuda")), torch.Generator(device="cuda").manual_seed(0)
    host, gpu = [], []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        _sampler_step(kind, requests, logits, state, gen)
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        if i >= 3:
            host.append((t1 - t0) * 1e3)
            gpu.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(gpu)


def time_engine(engine: Engine, batch: int, fields: dict, steps: int = 30) -> float:
    """Median ms of an overlapped decode step, `batch` greedy requests of 512-token prompts."""
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True, **fields)
    for _ in range(batch):
        engine.add_request(np.random.randint(3, VOCAB, 512).tolist(), params)
    while any(not r.output_ids for r in engine.requests.values()):
        engine.step()  # prefills
    for _ in range(3):
        engine.step()  # graph capture
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--outputs", default="256,2048", help="output tokens already generated per request")
    parser.add_argument("--engine", choices=list(SHAPES), help="also time whole decode steps of this model")
    args = parser.parse_args()
    kinds = ("off", "bias", "tables", "host lists")
    print(f"\n{torch.cuda.get_device_name()}; sampler alone, vocab {VOCAB}, prompts {PROMPT} tokens; "
          "median ms per step, host / GPU")
    print(f"{'B':>5}{'outputs':>9}" + "".join(f"{k:>20}" for k in kinds))
    for batch in map(int, args.batches.split(",")):
        for outputs in map(int, args.outputs.split(",")):
            cells = [time_sampler(k, batch, outputs) for k in kinds]
            print(f"{batch:>5}{outputs:>9}" + "".join(f"{h:>11.3f} /{g:>7.3f}" for h, g in cells))
    if args.engine:
        shape = SHAPES[args.engine]
        path = write_random_checkpoint(shape, scratch_dir(shape.checkpoint_bytes()), "cuda")
        engine = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_num_seqs=64,
                                        num_kv_blocks=64 * 40, max_model_len=640)
        runs = {"off": {}, "bias": {"logit_bias": BIAS}, "penalties": PENALTIES}
        cells = {name: time_engine(engine, 64, fields) for name, fields in runs.items()}
        print(f"\n{torch.cuda.get_device_name()}; {args.engine}; batch 64; median ms per overlapped decode step")
        print("".join(f"{name:>12}" for name in cells))
        print("".join(f"{ms:>12.2f}" for ms in cells.values()))


if __name__ == "__main__":
    main()
