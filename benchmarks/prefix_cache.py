"""Prefix caching: time to first token and throughput with caching off and on, side by side
on one backbone, for a shared-system-prompt workload and a multi-turn chat.

    PYTHONPATH=. python3 benchmarks/prefix_cache.py --model 1b     # GPU
    PYTHONPATH=. python3 benchmarks/prefix_cache.py --smoke        # CPU, tiny model, seconds
    PYTHONPATH=. python3 benchmarks/prefix_cache.py --model 1b --workloads spread --mixed-graphs on

Each workload runs with prefix caching off and on, each with mixed-step CUDA graphs
(EngineConfig.mixed_graph_tokens) off and on (--mixed-graphs narrows it; --workloads
picks workloads: spread, burst, chat). On the CPU (--smoke) no graph is captured: "on"
runs the same padded forward eagerly.

Shared system prompts: 8 applications x 2 LoRA adapters each (rank 16, every projection),
one system prompt per application (1,000 tokens), user turns of 50-200 tokens, greedy
answers of 32 tokens; 64 users, each sending its next request when its last one ends.
Multi-turn: 16 chats of 8 turns, each turn resending the whole conversation (system prompt,
earlier turns and answers) plus a new user turn. Users start spread over the steps of one
answer (user i before step i * answer_tokens / users), so arrivals are spread as in live
traffic; the `burst` row starts all 64 at once: every answer then has the same length, so
the users stay in lock-step waves and each first token waits for the prefills of the whole
wave's cohort. Every case runs on a fresh engine after a warm-up of the same lengths on
other prompts (so no hit comes from the warm-up, and no Triton compile from the timed run).
TTFT: add_request to the step that returns the first token; tokens/s: generated tokens over
the run's wall time. Per launched batch (decode: only decodes; mixed: prefill tokens too), the
medians of its launch on the host (the runner's call) and of its span on the GPU (events
before and after the launch: when the host is slower than the kernels, the GPU waits for
each launch, and the span is the launch's).
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
from adapterserve.engine.graphs import graph_limits
from adapterserve.engine.sampling_params import SamplingParams
from benchmarks.backbone import Backbone, add_model_arguments, model_target, random_backbone
from benchmarks.measure import sync
from benchmarks.random_adapters import AdapterFactory


@dataclass(frozen=True)
class Workload:
    apps: int
    adapters_per_app: int
    system_tokens: int
    user_tokens: tuple[int, int]
    answer_tokens: int
    users: int
    requests_per_user: int
    chats: int
    turns: int


FULL = Workload(8, 2, 1000, (50, 200), 32, 64, 4, 16, 8)
SMOKE = Workload(2, 2, 48, (4, 12), 4, 4, 2, 2, 3)


@dataclass
class Result:
    ttft: list[float]
    tokens: int
    wall: float
    prompt_tokens: int
    cached_tokens: int
    launches: list[tuple[bool, float, object, object]]  # per batch: (mixed, host s, GPU start/end events)
    mixed_replays: int = 0  # launches with prefill tokens that replayed a mixed-step graph
    mixed_captures: int = 0  # mixed-step graphs captured during the timed run (warm-up missed them)

    def step_ms(self, mixed: bool) -> str:
        """'host / GPU' median ms of the launches of one kind."""
        mine = [(host, start, end) for m, host, start, end in self.launches if m == mixed]
        if not mine:
            return "-"
        host = f"{1e3 * statistics.median(h for h, _, _ in mine):.2f}"
        if mine[0][1] is None:  # CPU: no GPU span
            return f"{host} / -"
        return f"{host} / {statistics.median(s.elapsed_time(e) for _, s, e in mine):.2f}"


class Conversations:
    """Who sends what: each user's (or chat's) next prompt and adapter, after its last answer."""

    def __init__(self, work: Workload, seed: int, vocab: int, multi_turn: bool) -> None:
        self.work, self.multi_turn, self.rng = work, multi_turn, random.Random(seed)
        self.vocab = vocab
        self.systems = [self._ids(work.system_tokens) for _ in range(work.apps)]
        count = work.chats if multi_turn else work.users
        self.left = {u: work.turns if multi_turn else work.requests_per_user for u in range(count)}
        self.history: dict[int, list[int]] = {}
        self.adapter: dict[int, str] = {}

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def next(self, user: int, answer: list[int]) -> tuple[list[int], str] | None:
        if self.left[user] == 0:
            return None
        self.left[user] -= 1
        turn = self._ids(self.rng.randint(*self.work.user_tokens))
        if self.multi_turn and user in self.history:
            self.history[user] += answer + turn
            return list(self.history[user]), self.adapter[user]
        app = self.rng.randrange(self.work.apps)
        adapter = f"app{app}-{self.rng.randrange(self.work.adapters_per_app)}"
        self.history[user], self.adapter[user] = self.systems[app] + turn, adapter
        return list(self.history[user]), adapter


def run(engine: Engine, talk: Conversations, answer_tokens: int, burst: bool) -> Result:
    """Each user sends its next prompt when its last answer ends; user i sends its first one
    before step i * answer_tokens / users (all before the first step if `burst`)."""
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    result, owner, added = Result([], 0, 0.0, 0, 0, []), {}, {}
    users = list(talk.left)
    starts = {u: 0 if burst else i * answer_tokens // len(users) for i, u in enumerate(users)}
    start, steps = time.perf_counter(), 0
    launch = engine.runner.run
    engine.runner.run = lambda batch, generators: _timed(launch, batch, generators, result.launches)

    def send(user: int, answer: list[int]) -> None:
        nxt = talk.next(user, answer)
        if nxt is not None:
            request = engine.add_request(nxt[0], params, nxt[1])
            owner[request.request_id], added[request.request_id] = (user, request), time.perf_counter()

    while starts or engine.has_unfinished():
        for user in [u for u, s in starts.items() if s <= steps]:
            del starts[user]
            send(user, [])
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            if out.request_id in added and out.token_ids:
                result.ttft.append(now - added.pop(out.request_id))
            if out.finished:
                user, request = owner.pop(out.request_id)
                result.tokens += len(request.output_ids)
                result.prompt_tokens += len(request.prompt_ids)
                result.cached_tokens += request.cached_tokens or 0
                send(user, list(request.output_ids))
    result.wall = time.perf_counter() - start
    engine.runner.run = launch
    return result


def _timed(launch, batch, generators, launches: list) -> object:
    """The runner's launch of one batch, its host time and GPU events recorded."""
    on_gpu = torch.cuda.is_available()
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if on_gpu else (None, None)
    if on_gpu:
        events[0].record()
    called = time.perf_counter()
    launched = launch(batch, generators)
    host = time.perf_counter() - called
    if on_gpu:
        events[1].record()
    launches.append((batch.num_tokens > len(batch.requests), host, *events))
    return launched


def fresh_engine(backbone: Backbone, factory: AdapterFactory, work: Workload, caching: bool, device: str,
                 dtype: str, mixed_tokens: int) -> Engine:
    longest = work.system_tokens + work.turns * (work.user_tokens[1] + work.answer_tokens) + 64
    users = max(work.users, work.chats)
    config = EngineConfig(device=device, dtype=dtype, max_loras=work.apps * work.adapters_per_app, max_lora_rank=16,
                          block_size=16, num_kv_blocks=users * -(-longest // 16) + 64, max_num_seqs=users,
                          max_num_batched_tokens=8192, max_model_len=longest, enable_prefix_caching=caching,
                          mixed_graph_tokens=mixed_tokens)
    engine = backbone.engine(config)
    if device != "cuda" and mixed_tokens:  # the padded forward, run eagerly (no capture off CUDA)
        engine.runner.enable_cuda_graphs(*graph_limits(config, engine.max_model_len))
    for i in range(work.apps * work.adapters_per_app):
        engine.add_adapter(f"app{i // work.adapters_per_app}-{i % work.adapters_per_app}", factory.lora(i))
    return engine


def case(backbone, factory, work: Workload, multi_turn: bool, burst: bool, caching: bool, device: str,
         dtype: str, vocab: int, mixed_tokens: int) -> Result:
    engine = fresh_engine(backbone, factory, work, caching, device, dtype, mixed_tokens)
    if engine.warmup is not None:
        reserved = torch.cuda.memory_reserved() / 2**30 if device == "cuda" else 0.0
        print(f"caching {'on' if caching else 'off'}, mixed graphs {mixed_tokens or 'off'}: "
              f"{engine.warmup.summary()}; {reserved:.1f} GiB reserved", flush=True)
    try:
        run(engine, Conversations(work, 100, vocab, multi_turn), work.answer_tokens, burst)  # warm-up: other prompts
        sync(device)
        mixed = engine.runner.mixed_graphs
        replays, graphs = (mixed.replays, mixed.num_graphs) if mixed is not None else (0, 0)
        result = run(engine, Conversations(work, 1, vocab, multi_turn), work.answer_tokens, burst)
        if mixed is not None:
            result.mixed_replays, result.mixed_captures = mixed.replays - replays, mixed.num_graphs - graphs
        return result
    finally:
        engine = None
        backbone.reset()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_table(rows: list[tuple[str, bool, bool, Result]], card: str, model: str, work: Workload) -> None:
    print(f"\n{card}; {model}; {work.apps} apps x {work.adapters_per_app} LoRA adapters, system prompt "
          f"{work.system_tokens} tokens, user turns {work.user_tokens[0]}-{work.user_tokens[1]}, answers "
          f"{work.answer_tokens} tokens; {work.users} users x {work.requests_per_user} requests; "
          f"multi-turn: {work.chats} chats x {work.turns} turns. Ratios: TTFT p50 of caching off, mixed graphs "
          "off over this row's; tokens/s of this row over that row's; TTFT p50 of this row with mixed graphs off "
          "over on")
    print("| workload | prefix caching | mixed graphs | TTFT p50 ms | TTFT p99 ms | tokens/s | prompt tokens cached "
          "| decode step ms, host / GPU | mixed step ms, host / GPU | mixed steps replayed (captured) "
          "| TTFT p50 vs off/off "
          "| tokens/s vs off/off | TTFT p50 graphs off/on |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    by_key = {(name, caching, mixed): r for name, caching, mixed, r in rows}
    for name, caching, mixed, r in rows:
        p50, p99 = 1e3 * statistics.median(r.ttft), 1e3 * percentile(r.ttft, 0.99)
        rate = r.tokens / r.wall
        base = by_key.get((name, False, False))
        versus = (f"{statistics.median(base.ttft) / statistics.median(r.ttft):.2f}x | "
                  f"{rate / (base.tokens / base.wall):.2f}x") if base is not None and base is not r else "- | -"
        eager = by_key.get((name, caching, False))
        graphs = (f"{statistics.median(eager.ttft) / statistics.median(r.ttft):.2f}x"
                  if mixed and eager is not None else "-")
        mixed_launches = sum(1 for m, *_ in r.launches if m)
        print(f"| {name} | {'on' if caching else 'off'} | {'on' if mixed else 'off'} | {p50:.1f} | {p99:.1f} "
              f"| {rate:.0f} | {100 * r.cached_tokens / r.prompt_tokens:.0f}% | {r.step_ms(False)} "
              f"| {r.step_ms(True)} | {r.mixed_replays} of {mixed_launches} ({r.mixed_captures}) "
              f"| {versus} | {graphs} |")


WORKLOADS = {"spread": ("shared system prompts", False, False), "burst": ("shared system prompts, burst", False, True),
             "chat": ("multi-turn chat", True, False)}


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--workloads", default="spread,burst,chat", help="comma-separated: spread, burst, chat")
    parser.add_argument("--mixed-graphs", default="both", choices=["both", "off", "on"],
                        help="mixed-step CUDA graphs off, on, or both side by side")
    parser.add_argument("--mixed-graph-tokens", type=int, default=EngineConfig.mixed_graph_tokens,
                        help="the largest mixed-graph token bucket when on")
    args = parser.parse_args()
    name, device, dtype = model_target(args)
    work = SMOKE if args.smoke else FULL
    chosen = [WORKLOADS[w] for w in args.workloads.split(",")]
    mixed_modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.mixed_graphs]
    started = time.perf_counter()
    backbone, shape = random_backbone(name, device, dtype)
    factory = AdapterFactory(shape, device)
    rows = [(label, caching, mixed, case(backbone, factory, work, multi_turn, burst, caching, device, dtype,
                                         shape.vocab, args.mixed_graph_tokens if mixed else 0))
            for label, multi_turn, burst in chosen for caching in (False, True) for mixed in mixed_modes]
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print_table(rows, card, f"{name} ({time.perf_counter() - started:.0f} s)", work)


if __name__ == "__main__":
    main()
