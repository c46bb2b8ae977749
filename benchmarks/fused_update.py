"""The decode LoRA update of a whole Llama-8B stack: today's kernels against the stacked GEMM.

    PYTHONPATH=. python benchmarks/fused_update.py            # H100/H200: ~3 min (--layers 16: half)
    PYTHONPATH=. python benchmarks/fused_update.py --quick    # H100: under 2 min, the ops table (below) alone
    PYTHONPATH=. python benchmarks/fused_update.py --smoke    # CPU, tiny shapes, seconds
    (with TRITON_INTERPRET=1 the smoke runs the Triton expands in the interpreter: minutes)

32 layers of q|k|v, o, gate|up and down (bf16, distinct weights and pools per layer, so
every read comes from HBM as in a decode step), B=64 tokens spread over 1, 8 or 64
rank-16 adapters, or 64 adapters of ranks 8/16/32/64. Each figure is one CUDA graph
replay of the whole stack's projections (every variant warmed up and run once before
its capture), for:
  - base:                the base GEMMs alone;
  - kernels:             base GEMM, then the segmented shrink and expand, one stream;
  - kernels+side:        the shrink on a side stream beside the GEMM (lora_decode="kernels");
  - stacked:             one GEMM over [W; A rows of the active adapters] and the tiled
                         expand with the tiles expand_tiles picks (lora_decode="stacked"
                         with the adapters packed low);
  - stacked n64 / n128:  the tiled expand with 64 / 128 columns per program (token tile
                         and warps as expand_tiles picks for that width);
  - stacked no-skip:     expand_tiles' tiles, no branch over unused row chunks (masked
                         loads), the row-chunk loop pipelined in 3 stages;
  - stacked-per-token:   the per-token expand (one program per token and 512 columns);
  - stacked grouped:     the grouped expand (kernels/stacked_grouped.py: a program per tile
                         of one adapter's tokens, as the segmented expand);
  - stacked grouped g128: (the sweep only) the grouped expand with 128 columns per program
                         (more programs for few adapters);
  - stacked auto:        the expand choose_expand picks from the step's distinct adapters
                         (tiled below GROUPED_MIN_ADAPTERS, grouped from it on): the engine;
  - stacked-pool:        the stacked variant's GEMM over every pool row (64 adapters resident);
  - stacked-gemm:        the stacked GEMM alone (what the expand adds is the difference).
Tax: over base. Floor: the bytes of the base weights and of the distinct adapters' A and B
rows at the copy bandwidth measured in the same run. Check: largest relative difference
between a stacked variant's and the kernels' outputs of the last projection, over the
stacked variants.

First a sweep over the count of distinct rank-16 adapters (1 to 64) of the tiled and the
grouped expands, and the crossover: the fewest distinct adapters from
which the grouped expand is faster at every count (what GROUPED_MIN_ADAPTERS should be).
Prints the main table last.

--quick (16 layers unless --layers says): the ops table alone (benchmarks/ops_stack.py):
the stack with its norms and SiLU-mul, as base+ops, kernels+ops and stacked+ops, each with
programmatic dependent launch off, "early" and "exit", for 1 and 8 rank-16 adapters and
none, 8 slots. Tax: over base+ops with PDL off. Check: per variant, "=" where the outputs
with PDL on equal those with it off (torch.equal, CUDA graph replays), then max
|out - ref| / max |ref| of the last layer's down and q|k|v outputs against a float32 torch run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapterserve.kernels import lora_expand, lora_shrink, reference, stacked_expand
from adapterserve.kernels.decode_gemm import decode_config, decode_gemm
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.stacked import (
    GROUPED_MIN_ADAPTERS,
    ExpandTiles,
    GroupedTiles,
    RowsInUse,
    expand_for_slots,
    expand_tiles,
    grouped_tiles,
    row_bucket,
    stack_weight,
    stacked_gemm,
)
from adapterserve.kernels.stacked_fused import stacked_fused
from adapterserve.kernels.stacked_grouped import stacked_expand_grouped
from adapterserve.kernels.stacked_tiled import stacked_expand_tiled
from adapterserve.kernels.stacked_triton import (
    stacked_expand as stacked_expand_per_token,
)
from benchmarks.checkpoints import SHAPES

SLOTS = 64
VARIANTS = ("base", "kernels", "kernels+side", "stacked", "stacked grouped", "stacked auto", "stacked n64",
            "stacked n128", "stacked no-skip", "stacked-per-token", "stacked-pool", "stacked-gemm")
CHECKED = ("stacked", "stacked grouped", "stacked auto", "stacked n64", "stacked n128", "stacked no-skip",
           "stacked-per-token", "stacked-pool")
SWEEP = (1, 2, 3, 4, 6, 8, 16, 32, 64)  # distinct rank-16 adapters of the crossover sweep
SWEEP_VARIANTS = ("stacked", "stacked grouped", "stacked grouped g128")


@dataclass(frozen=True)
class Scenario:
    name: str
    adapters: int  # distinct adapters among the tokens (slots 0..adapters-1)
    ranks: tuple[int, ...]  # rank of every slot of the pool


def scenarios(slots: int) -> list[Scenario]:
    r16 = (16,) * slots
    mixed = tuple((8, 16, 32, 64)[i % 4] for i in range(slots))
    counts = sorted({1, min(8, slots), slots})
    return [Scenario(f"{n} x r16", n, r16) for n in counts] + [Scenario(f"{slots} x r8-64", slots, mixed)]


class Projection:
    """One layer's fused projection: a [W; A] buffer, its B pool, and a contiguous copy of A
    (the kernels path's pool layout)."""

    def __init__(self, k: int, widths: tuple[int, ...], ranks: tuple[int, ...], device: str, dtype) -> None:
        self.k, self.n_slices = k, len(widths)
        offsets = [0]
        for w in widths:
            offsets.append(offsets[-1] + w)
        pool_rows = sum(ranks)
        weight = torch.randn(offsets[-1], k, device=device, dtype=dtype) * 0.02
        self.stacked = stack_weight(weight, len(widths), pool_rows, RowsInUse())
        del weight
        a = self.stacked.lora_a()
        a.copy_(torch.randn(a.shape, device=device, dtype=dtype) * 0.02)
        b = torch.randn(pool_rows, offsets[-1], device=device, dtype=dtype) * 0.02
        starts = torch.tensor([0] + list(ranks[:-1]), device=device).cumsum(0).to(torch.int32)
        row_start = starts.repeat(len(widths), 1).contiguous()
        rank = torch.tensor(ranks, device=device, dtype=torch.int32).repeat(len(widths), 1).contiguous()
        self.lora_stacked = LoraSlices(a, b, row_start, rank, tuple(offsets), max(ranks))
        self.lora_kernels = LoraSlices(a.contiguous(), b, row_start, rank, tuple(offsets), max(ranks))
        self.own_config = decode_config(offsets[-1], k)  # the engine's tiles (decode_gemm.py's sweep sets others)

    def floor_bytes(self, ranks: tuple[int, ...], adapters: int) -> int:
        n = self.lora_stacked.out_offsets[-1]
        lora_rows = sum(ranks[:adapters])
        return (n * self.k + lora_rows * self.n_slices * self.k + lora_rows * n) * self.stacked.buffer.element_size()


class Stack:
    def __init__(self, shape, layers: int, tokens: int, ranks: tuple[int, ...], device: str, dtype) -> None:
        lin, h, inter = shape.linear_shapes(), shape.hidden, shape.inter
        kinds = [(h, (lin["q_proj"][1], lin["k_proj"][1], lin["v_proj"][1])), (lin["o_proj"][0], (h,)),
                 (h, (inter, inter)), (inter, (h,))]
        self.projections = [Projection(k, widths, ranks, device, dtype) for _ in range(layers) for k, widths in kinds]
        self.x = {k: torch.randn(tokens, k, device=device, dtype=dtype) for k, _ in kinds}
        self.workspace = torch.empty(3, tokens, max(ranks), device=device, dtype=dtype)
        self.side = torch.cuda.Stream() if device == "cuda" else None
        self.pool_rows = sum(ranks)
        self.num_slots = len(ranks)

    def run(self, variant: str, meta, rows: int) -> torch.Tensor:
        """Every projection of the stack as `variant` says; the last projection's output."""
        y = None
        for p in self.projections:
            y = self._projection(p, variant, meta, rows)
        return y

    def _projection(self, p: Projection, variant: str, meta, rows: int) -> torch.Tensor:
        rows = self.pool_rows if variant == "stacked-pool" else rows
        return project(p, variant, self.x[p.k], meta, rows, self.workspace[: p.n_slices], self.side)


def project(p: Projection, variant: str, x: torch.Tensor, meta, rows: int, workspace: torch.Tensor,
            side: torch.cuda.Stream | None) -> torch.Tensor:
    """x through projection p as `variant` says (the module docstring's list): base, own (our
    decode GEMM, kernels/decode_gemm.py, with p.own_config), fused (kernels/stacked_fused.py,
    the same tiles), kernels, kernels+side (the shrink on `side`), or a stacked one over
    `rows` pool rows."""
    if variant == "base":
        return F.linear(x, p.stacked.weight())
    if variant == "own":
        return decode_gemm(x, p.stacked.weight(), p.own_config)
    if variant == "fused":
        return stacked_fused(x, p.stacked, p.lora_stacked, meta, rows, config=p.own_config)
    if variant.startswith("stacked"):
        out = stacked_gemm(x, p.stacked, rows)
        if variant == "stacked-gemm":
            return out
        y = torch.empty(x.shape[0], p.stacked.n_out, device=x.device, dtype=x.dtype)
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            reference.stacked_expand(out, p.lora_stacked, meta, y)  # smoke without the interpreter
        elif variant == "stacked-per-token":
            stacked_expand_per_token(out, p.lora_stacked, meta, y)
        elif variant == "stacked auto":  # the engine's dispatch, with the step's choice
            stacked_expand(out, p.lora_stacked, meta, y, expand=meta.stacked_expand)
        elif variant == "stacked grouped":
            stacked_expand_grouped(out, p.lora_stacked, meta, y)
        elif variant == "stacked grouped g128":
            chosen = grouped_tiles(p.lora_stacked.max_rank)
            stacked_expand_grouped(out, p.lora_stacked, meta, y, tiles=GroupedTiles(chosen.block_r, 128, 128))
        else:
            stacked_expand_tiled(out, p.lora_stacked, meta, y, tiles=_tiles(variant, x.shape[0], p))
        return y
    if variant == "kernels+side" and side is not None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lora_shrink(x, p.lora_kernels, meta, workspace)
        y = F.linear(x, p.stacked.weight())
        main.wait_stream(side)
    else:
        y = F.linear(x, p.stacked.weight())
        lora_shrink(x, p.lora_kernels, meta, workspace)
    lora_expand(workspace, p.lora_kernels, meta, y)
    return y


def _tiles(variant: str, tokens: int, p: Projection) -> ExpandTiles | None:
    """The tiled expand's tiles: expand_tiles' choice, or its choice at a forced width or
    without the branch."""
    if variant == "stacked no-skip":
        chosen = expand_tiles(tokens, p.stacked.n_out)
        return ExpandTiles(chosen.block_m, chosen.block_n, chosen.warps, skip_unused=False, stages=3)
    if not variant.startswith("stacked n"):
        return None
    block_n = int(variant.removeprefix("stacked n"))
    chosen = expand_tiles(tokens, p.stacked.n_out)
    return ExpandTiles(chosen.block_m, block_n, 8 if chosen.block_m * block_n >= 8192 else 4)


def time_ms(run, device: str) -> float:
    """One CUDA graph replay (median) on a GPU; the median eager run elsewhere."""
    if device == "cuda":
        from benchmarks.measure import graph_ms

        run()  # compile every Triton variant before graph_ms's own warm-up and capture
        torch.cuda.synchronize()
        return graph_ms(run)
    run()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bandwidth(device: str) -> float:
    if device != "cuda":
        return float("nan")
    from benchmarks.measure import copy_bandwidth

    return copy_bandwidth("cuda", 1 << 30)


def step_meta(tokens: int, adapters: int, num_slots: int, device: str):
    """The step's metadata: tokens spread round-robin over slots 0..adapters-1, with the
    expand the engine would choose for them."""
    slots = (torch.arange(tokens) % adapters).to(torch.int32)
    return build_adapter_meta(slots.to(device), num_slots, stacked_expand=expand_for_slots(slots.numpy()))


def measure(stack: Stack, scenario: Scenario, tokens: int, device: str, bw: float) -> list[str]:
    meta = step_meta(tokens, scenario.adapters, len(scenario.ranks), device)
    rows = row_bucket(sum(scenario.ranks[: scenario.adapters]), stack.pool_rows)
    ms = {v: time_ms(lambda v=v: stack.run(v, meta, rows), device) for v in VARIANTS}
    want = stack.run("kernels", meta, rows).float()
    check = max(float((stack.run(v, meta, rows).float() - want).norm() / want.norm()) for v in CHECKED)
    floor = sum(p.floor_bytes(scenario.ranks, scenario.adapters) for p in stack.projections) / bw * 1e3
    base = ms["base"]
    cells = [f"{ms[v]:.3f}" + ("" if v == "base" else f" ({(ms[v] / base - 1) * 100:+.1f}%)") for v in VARIANTS]
    return [scenario.name, str(rows), *cells, f"{floor:.3f}", f"{ms['stacked auto'] / floor:.2f}", f"{check:.1e}"]


def sweep(stack: Stack, counts: list[int], tokens: int, device: str) -> list[tuple[int, dict[str, float]]]:
    """ms of SWEEP_VARIANTS for each count of distinct adapters (rank 16, packed low)."""
    out = []
    for n in counts:
        meta = step_meta(tokens, n, stack.num_slots, device)
        rows = row_bucket(16 * n, stack.pool_rows)
        out.append((n, {v: time_ms(lambda v=v, meta=meta, rows=rows: stack.run(v, meta, rows), device)
                        for v in SWEEP_VARIANTS}))
    return out


def crossover(results: list[tuple[int, dict[str, float]]]) -> int | None:
    """The fewest distinct adapters from which the grouped expand beats the tiled one at
    every count measured (None: it never does at the largest)."""
    best = None
    for n, ms in reversed(results):
        if ms["stacked grouped"] >= ms["stacked"]:
            break
        best = n
    return best


def print_table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def run_all(shape, layers: int, tokens: int, slots: int, device: str, dtype, bw: float
            ) -> tuple[list[list[str]], list[tuple[int, dict[str, float]]]]:
    """The main table's rows and the sweep, one stack per set of pool ranks."""
    rows, swept = [], []
    by_ranks: dict[tuple[int, ...], list[Scenario]] = {}
    for scenario in scenarios(slots):
        by_ranks.setdefault(scenario.ranks, []).append(scenario)
    for ranks, group in by_ranks.items():
        stack = Stack(shape, layers, tokens, ranks, device, dtype)
        if set(ranks) == {16}:
            swept = sweep(stack, [n for n in SWEEP if n <= slots], tokens, device)
        rows += [measure(stack, scenario, tokens, device, bw) for scenario in group]
        del stack
        if device == "cuda":
            torch.cuda.empty_cache()  # the stack is gone: make room for the next
    return rows, swept


def report(setting: str, bw: float, rows: list[list[str]], swept: list[tuple[int, dict[str, float]]]) -> None:
    print(f"\n{setting}; ms per step of q|k|v, o, gate|up, down by distinct rank-16 adapters:")
    print_table(["adapters", *[f"{v} ms" for v in SWEEP_VARIANTS], "grouped / tiled", "auto picks"],
                [[str(n), *[f"{ms[v]:.3f}" for v in SWEEP_VARIANTS], f"{ms['stacked grouped'] / ms['stacked']:.2f}",
                  expand_for_slots(list(range(n)))] for n, ms in swept])
    cross = crossover(swept)
    verdict = (f"faster than the tiled one from {cross} distinct adapters on" if cross is not None
               else "not faster than the tiled one at the largest count")
    print(f"\ncrossover: the grouped expand is {verdict} (GROUPED_MIN_ADAPTERS = {GROUPED_MIN_ADAPTERS})")
    print(f"\n{setting}; copy bandwidth {bw / 1e9:.0f} GB/s; ms per step of q|k|v, o, gate|up, down (tax over base):")
    print_table(["adapters", "stacked rows", *[f"{v} ms" for v in VARIANTS], "floor ms", "auto / floor", "check"],
                rows)


OPS_SLOTS = 8  # adapter slots of the ops table's pools
OPS_ADAPTERS = (1, 8, 0)  # its scenarios: distinct rank-16 adapters (0: none)


def ops_table(setting: str, shape, layers: int, tokens: int, slots: int, device: str, dtype, bw: float) -> None:
    """The stack with its ops, PDL off and on (benchmarks/ops_stack.py), printed as one table."""
    from benchmarks import ops_stack

    stack = ops_stack.OpsStack(shape, layers, tokens, slots, device, dtype)
    rows = [ops_stack.measure(stack, n, tokens, device, bw, time_ms) for n in OPS_ADAPTERS if n <= slots]
    print(f"\n{setting}, {slots} slots; copy bandwidth {bw / 1e9:.0f} GB/s; ms per step of the stack with "
          "its ops (tax over base+ops, PDL off):")
    print_table(ops_stack.header(), rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="layers of the stack (32; 16 with --quick)")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes: the code runs, figures mean nothing")
    p.add_argument("--quick", action="store_true", help="the ops table alone (PDL off and on), 16 layers")
    args = p.parse_args()
    layers = args.layers or (16 if args.quick else 32)
    if args.smoke:
        device, dtype, shape, layers, tokens, slots = "cpu", torch.float32, SHAPES["tiny"], 2, 8, 4
        name = "CPU (smoke)"
    else:
        device, dtype, shape, tokens, slots = "cuda", torch.bfloat16, SHAPES["8b"], 64, SLOTS
        name = torch.cuda.get_device_name()
    torch.manual_seed(0)
    bw = bandwidth(device)
    setting = (f"{name}; torch {torch.__version__}; {shape.name}, {layers} layers, B={tokens}, {dtype}; "
               + ("one CUDA graph replay per figure" if device == "cuda" else "eager, median of 3"))
    if args.quick:
        ops_table(setting, shape, layers, tokens, min(OPS_SLOTS, slots), device, dtype, bw)
        return
    rows, swept = run_all(shape, layers, tokens, slots, device, dtype, bw)
    report(setting, bw, rows, swept)


if __name__ == "__main__":
    main()
