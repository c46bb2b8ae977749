"""LoRA kernel benchmark (issue 3): Triton shrink+expand against its baselines.

For each (hidden d, ranks, tokens, distinct adapters), with q/k/v fused (GQA widths):
  base       the frozen projection GEMM alone, x @ W^T
  ours       lora_shrink + lora_expand (CUDA graph replay; "eager" = plain launches)
  gather+bmm A[slot] and B[slot] gathered per token, then torch.bmm
  loop       a per-adapter loop as PEFT runs it (eager, host-bound)
  floor      minimal bytes (x read, y read and written, each distinct adapter's
             weights once) over the device-to-device copy bandwidth of this run
Every variant reads rotating input sets and the L2 is flushed before each timed
replay, so weights come from device memory. Medians of triton.testing.do_bench.

Run on a GPU:  PYTHONPATH=. python3 benchmarks/lora_kernels.py [--quick] [--sweep] [--json FILE]
Prints one table naming the GPU, then the targets; writes the "LoRA kernels"
section of BENCHMARKS.md (other sections kept). --sweep first times block shapes on
the target shapes and uses the fastest (copy them into segment_ops afterwards);
--render FILE rebuilds the section from a --json file, without a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SECTION = "## LoRA kernels"
WIDTHS = {2048: (2048, 512, 512), 4096: (4096, 1024, 1024), 8192: (8192, 1024, 1024)}
MIXED = (8, 16, 64)
SET_BUDGET = 6 << 30  # bytes of weights + activations across rotating sets
DENSE_BUDGET = 6 << 30  # padded per-slot copies for the torch baselines
GATHER_BUDGET = 4 << 30  # temporaries of gather+bmm
LOOP_MAX_ADAPTERS = 1024
DEVICE = "cuda"
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Case:
    hidden: int
    rank: int | str  # an int, or "mixed" (adapters cycle through MIXED)
    tokens: int
    adapters: int

    @property
    def widths(self) -> tuple[int, ...]:
        return WIDTHS[self.hidden]

    def ranks(self) -> list[int]:
        return [MIXED[i % 3] if self.rank == "mixed" else int(self.rank) for i in range(self.adapters)]

    @property
    def max_rank(self) -> int:
        return max(self.ranks())

    def weight_bytes(self) -> int:
        return sum(self.ranks()) * (3 * self.hidden + sum(self.widths)) * 2

    def act_bytes(self) -> int:
        return self.tokens * (self.hidden + 2 * sum(self.widths)) * 2

    def floor_bytes(self) -> int:
        return self.act_bytes() + self.weight_bytes()


def grid(quick: bool) -> list[Case]:
    """The targets first (so a time budget never drops them), then the full grid."""
    first = [Case(4096, r, t, a) for r in (16, 64, "mixed") for t, a in ((64, 64), (4096, 128), (4096, 1024))]
    hiddens = (4096,) if quick else (2048, 4096, 8192)
    tokens = (1, 64, 4096) if quick else (1, 16, 64, 256, 1024, 4096)
    rest = [
        Case(d, rank, t, a)
        for d in hiddens
        for rank in (8, 16, 64, "mixed")
        for t in tokens
        for a in sorted({1, t // 4, t} - {0})
    ]
    return first + [c for c in rest if c not in first]


# timing -------------------------------------------------------------------


def bench(fn, calls: int = 1) -> float:
    """Median microseconds of one call; fn runs `calls` calls."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3 / calls


def graph_bench(fns: list) -> float:
    """Capture fns (one call each) into one CUDA graph; median microseconds per call."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    us = bench(graph.replay, len(fns))
    del graph
    return us


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (us * 1e-6)


def empty_launches() -> tuple[float, float]:
    """Two empty Triton launches: (graph, eager) microseconds."""
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(p):
        tl.program_id(0)

    p = torch.empty(1, device="cuda")

    def two():
        _empty[(1,)](p)
        _empty[(1,)](p)

    return graph_bench([two] * 8), bench(two)


# inputs -------------------------------------------------------------------


def make_sets(case: Case, n_sets: int, gen: torch.Generator):
    """Pool of n_sets * adapters slots, and per set x, y, v, slots, meta."""
    from adapterserve.kernels import LoraSlices, build_adapter_meta

    ranks = case.ranks() * n_sets
    slots_total = len(ranks)
    row_start = torch.tensor([0] + ranks[:-1]).cumsum(0).to(torch.int32)
    rows, k, n = sum(ranks), case.hidden, sum(case.widths)
    dev, bf = DEVICE, DTYPE
    a = (torch.randn(3, rows, k, device=dev, dtype=bf, generator=gen) * k**-0.5)
    b = (torch.randn(rows, n, device=dev, dtype=bf, generator=gen) * case.max_rank**-0.5)
    offs = (0,) + tuple(int(v) for v in torch.tensor(case.widths).cumsum(0))
    lora = LoraSlices(
        a, b, row_start.repeat(3, 1).to(dev).contiguous(),
        torch.tensor(ranks, dtype=torch.int32).repeat(3, 1).to(dev).contiguous(), offs, case.max_rank,
    )
    base = (torch.arange(case.tokens) * case.adapters) // case.tokens
    sets = []
    for i in range(n_sets):
        slots = (base + i * case.adapters).to(torch.int32)
        sets.append(dict(
            x=torch.randn(case.tokens, k, device=dev, dtype=bf, generator=gen),
            y=torch.randn(case.tokens, n, device=dev, dtype=bf, generator=gen),
            v=torch.empty(3, case.tokens, case.max_rank, device=dev, dtype=bf),
            slots=slots.to(dev), host_slots=slots, meta=build_adapter_meta(slots.to(dev), slots_total),
        ))
    return lora, sets


def dense_weights(lora, case: Case, n_slots: int):
    """Per-slot padded copies: A [S, 3*mr, K] and B per slice [S, mr, w_s] (zeros past rank)."""
    mr, k = case.max_rank, case.hidden
    r = torch.arange(mr, device=DEVICE)
    rows = (lora.row_start[0, :n_slots, None] + r).clamp(max=lora.a.shape[1] - 1).long()  # [S, mr]
    keep = (r < lora.rank[0, :n_slots, None]).to(DTYPE)[:, :, None]
    a = torch.stack([lora.a[s][rows] * keep for s in range(3)], 1).view(n_slots, 3 * mr, k)
    offs = lora.out_offsets
    bs = [(lora.b[:, offs[s] : offs[s + 1]][rows] * keep).contiguous() for s in range(3)]
    return a, bs


# variants -----------------------------------------------------------------


def ours(lora, st, path: str = "default"):
    """Shrink + expand: the public ops ("default"), or forced onto one kernel family ("gemv", "dot")."""
    from adapterserve.kernels import lora as triton_lora

    if path == "default":
        def run():
            triton_lora.lora_shrink(st["x"], lora, st["meta"], st["v"])
            triton_lora.lora_expand(st["v"], lora, st["meta"], st["y"])

        return run
    down, up = _configs(lora, path)
    shrink, expand = _shrink_with(lora, st, down), _expand_with(lora, st, up)
    return lambda: (shrink(), expand())


def gather_bmm(dense_a, dense_bs, lora, st, mr: int):
    x, y, slots, offs = st["x"], st["y"], st["slots"].long(), lora.out_offsets

    def run():
        v = torch.bmm(dense_a[slots], x.unsqueeze(2))  # [T, 3*mr, 1]
        for s, bd in enumerate(dense_bs):
            u = torch.bmm(v[:, s * mr : (s + 1) * mr].transpose(1, 2), bd[slots])
            y[:, offs[s] : offs[s + 1]] += u.squeeze(1)

    return run


def peft_loop(dense_a, dense_bs, lora, st, ranks: list[int], mr: int):
    """Per target module, per adapter in the batch: gather rows, A, B, scatter-add."""
    x, y, offs = st["x"], st["y"], lora.out_offsets
    groups = []
    for slot in st["host_slots"].unique().tolist():
        idx = (st["host_slots"] == slot).nonzero().squeeze(1).to(DEVICE)
        groups.append((slot, idx, ranks[slot]))

    def run():
        for s, bd in enumerate(dense_bs):
            cols = slice(offs[s], offs[s + 1])
            for slot, idx, r in groups:
                sub = x[idx]
                out = (sub @ dense_a[slot, s * mr : s * mr + r].T) @ bd[slot, :r]
                y[idx, cols] += out

    return run


def base_gemm(w, st):
    out = torch.empty_like(st["y"])
    return lambda: torch.mm(st["x"], w.T, out=out)


def check(lora, st, case: Case, seed: int, path: str = "default") -> float:
    """Relative error of ours against a float32 gather oracle on up to 128 tokens."""
    y0 = st["y"].clone()
    ours(lora, st, path)()
    pick = torch.randperm(case.tokens)[:128].to(DEVICE)
    slots = st["slots"].long()[pick]
    r = torch.arange(case.max_rank, device=DEVICE)
    ref = y0[pick].float()
    for s in range(3):
        ranks, starts = lora.rank[s][slots], lora.row_start[s][slots]
        rows = (starts[:, None] + r).clamp(max=lora.a.shape[1] - 1)
        keep = (r < ranks[:, None]).float()
        v = torch.einsum("tk,trk->tr", st["x"][pick].float(), lora.a[s][rows].float()) * keep
        cols = slice(lora.out_offsets[s], lora.out_offsets[s + 1])
        ref[:, cols] += torch.einsum("tr,trn->tn", v, lora.b[rows][:, :, cols].float())
    upd, ref_upd = st["y"][pick].float() - y0[pick].float(), ref - y0[pick].float()
    st["y"].copy_(y0)
    err = float((upd - ref_upd).norm() / ref_upd.norm())
    if not err < 2e-2:  # keep timing the rest, but say so loudly
        print(f"WRONG RESULT {case} ({path}): rel err {err:.2e} (seed {seed})", flush=True)
    return err


def run_case(case: Case, gen: torch.Generator, seed: int, split: bool = False) -> dict:
    """Times of every variant; "gemv"/"dot" are the two kernel families of ours."""
    from adapterserve.kernels.segment_ops import GEMV_MAX_RANK, GEMV_TOKENS, use_gemv

    set_bytes = case.weight_bytes() + case.act_bytes()
    n_sets = max(1, min(8, SET_BUDGET // max(set_bytes, 1)))
    lora, sets = make_sets(case, n_sets, gen)
    res = dict(case=case, n_sets=n_sets)
    # both kernel families for decode-sized batches; "ours" is the one use_gemv picks
    paths = ["gemv", "dot"] if case.tokens <= GEMV_TOKENS and case.max_rank <= GEMV_MAX_RANK else ["dot"]
    y_init = sets[0]["y"].clone()  # timing loops keep adding into y; check on fresh values
    for name in paths:
        sets[0]["y"].copy_(y_init)
        res[f"err_{name}"] = check(lora, sets[0], case, seed, name)
        res[name] = graph_bench([ours(lora, st, name) for st in sets])
        if split:
            down, up = _configs(lora, name)
            res[f"{name}_shrink"] = graph_bench([_shrink_with(lora, st, down) for st in sets])
            res[f"{name}_expand"] = graph_bench([_expand_with(lora, st, up) for st in sets])
    res["eager"] = bench(ours(lora, sets[0]))
    res["eager_path"] = "gemv" if use_gemv(case.tokens, case.max_rank) else "dot"
    w = torch.randn(sum(case.widths), case.hidden, device=DEVICE, dtype=DTYPE, generator=gen)
    res["base"] = graph_bench([base_gemm(w, st) for st in sets])
    n_slots = n_sets * case.adapters
    dense = n_slots * case.max_rank * (3 * case.hidden + sum(case.widths)) * 2
    gather = case.tokens * case.max_rank * (3 * case.hidden + max(case.widths)) * 2
    if dense <= DENSE_BUDGET:
        da, dbs = dense_weights(lora, case, n_slots)
        if gather <= GATHER_BUDGET:
            res["gather"] = graph_bench([gather_bmm(da, dbs, lora, st, case.max_rank) for st in sets])
        if case.adapters <= LOOP_MAX_ADAPTERS:
            res["loop"] = bench(peft_loop(da, dbs, lora, sets[0], lora.rank[0].tolist(), case.max_rank))
    return res


# report -------------------------------------------------------------------


def fmt(us: float | None) -> str:
    if us is None:
        return "—"
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def settle(r: dict) -> dict:
    """Pick the kernel family the ops choose (use_gemv); the other one, if measured, is shown beside it."""
    from adapterserve.kernels.segment_ops import use_gemv

    use = "gemv" if "gemv" in r and use_gemv(r["case"].tokens, r["case"].max_rank) else "dot"
    other = {"gemv": "dot", "dot": "gemv"}[use]
    r.update(ours=r[use], path=use, other=r.get(other), err=r[f"err_{use}"])
    r["shrink"], r["expand"] = r.get(f"{use}_shrink"), r.get(f"{use}_expand")
    return r


def table(rows: list[dict], bw: float) -> str:
    head = (
        "| d | rank | tokens | adapters | base GEMM | ours | kernels | other kernels | ours eager | gather+bmm "
        "| PEFT loop | floor | ours/floor | gather/ours | err |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in map(settle, rows):
        c, floor = r["case"], r["case"].floor_bytes() / bw * 1e6
        g = r.get("gather")
        speedup = "—" if g is None else f"{g / r['ours']:.1f}"
        eager = r["eager"] if r["eager_path"] == r["path"] else None
        err = "n/c" if r["err"] is None else f"{r['err']:.0e}"
        lines.append(
            f"| {c.hidden} | {c.rank} | {c.tokens} | {c.adapters} | {fmt(r['base'])} | {fmt(r['ours'])} | {r['path']} | "
            f"{fmt(r['other'])} | {fmt(eager)} | {fmt(g)} | {fmt(r.get('loop'))} | {fmt(floor)} | "
            f"{r['ours'] / floor:.2f} | {speedup} | {err} |"
        )
    return "\n".join(lines)


def splits(rows: list[dict]) -> str:
    lines = ["| case | kernels | shrink | expand | both (one graph) |", "|---|---|---|---|---|"]
    for r in map(settle, rows):
        if r["shrink"] is not None:
            c = r["case"]
            name = f"d={c.hidden} r{c.rank} {c.tokens} tok / {c.adapters} ad"
            lines.append(f"| {name} | {r['path']} | {r['shrink']:.1f} | {r['expand']:.1f} | {r['ours']:.1f} |")
    return "\n".join(lines)


def find(rows: list[dict], **kw) -> dict | None:
    for r in rows:
        if all(getattr(r["case"], k) == v for k, v in kw.items()):
            return r
    return None


def _target(what: str, measured: str, goal: str, ok: bool) -> str:
    return f"| {what} | {measured} | {goal} | {'yes' if ok else 'no'} |"


def targets(rows: list[dict], bw: float, empty2: float) -> str:
    rows = [settle(r) for r in rows]
    out = ["| target | measured | goal | reached |", "|---|---|---|---|"]
    dec = find(rows, hidden=4096, rank=16, tokens=64, adapters=64)
    if dec:
        floor = dec["case"].floor_bytes() / bw * 1e6
        if dec.get("gather"):
            sp = dec["gather"] / dec["ours"]
            what = "decode 64 tok / 64 rank-16 adapters, d=4096 qkv: gather+bmm / ours"
            out.append(_target(what, f"{sp:.1f}×", "≥ 4×", sp >= 4))
        q = dec["ours"] / max(floor, empty2)
        what = f"same: ours / max(floor {floor:.1f} µs, two empty launches {empty2:.1f} µs)"
        out.append(_target(what, f"{q:.2f}×", "≤ 2×", q <= 2))
    for rank in (16, 64, "mixed"):
        pre = find(rows, hidden=4096, rank=rank, tokens=4096, adapters=128)
        if pre:
            q = pre["ours"] / (pre["case"].floor_bytes() / bw * 1e6)
            what = f"prefill 4096 tok / 128 adapters, rank {rank}, d=4096: ours / floor"
            out.append(_target(what, f"{q:.2f}×", "≤ 1.5×", q <= 1.5))
    for t, a in ((64, 64), (4096, 128), (4096, 1024)):
        mix = find(rows, hidden=4096, rank="mixed", tokens=t, adapters=a)
        full = find(rows, hidden=4096, rank=64, tokens=t, adapters=a)
        if mix and full:
            ranks = sum(mix["case"].ranks()) / sum(full["case"].ranks())
            want = mix["case"].floor_bytes() / full["case"].floor_bytes()  # bytes: Σ ranks plus activations
            got = mix["ours"] / full["ours"]
            what = f"mixed {{8,16,64}} vs all 64, {t} tok / {a} adapters: time ratio (Σ ranks {ranks:.2f}, floor bytes {want:.2f})"
            out.append(_target(what, f"{got:.2f}", f"≤ 1.25 × {want:.2f}", got <= 1.25 * want))
    return "\n".join(out)


def section(rows, meta: dict) -> str:
    bw, empty = meta["bw"], meta["empty"]
    return "\n\n".join([
        SECTION,
        f"Measured {meta['date']} on **{meta['device']}** (torch {meta['torch']}, triton {meta['triton']}) by "
        "`benchmarks/lora_kernels.py`. Times in µs, medians; bf16; q/k/v fused with GQA widths "
        "(d=2048: 2048/512/512, 4096: 4096/1024/1024, 8192: 8192/1024/1024); mixed = adapters cycling ranks 8/16/64. "
        f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write); two empty launches {empty[0]:.1f} µs in a graph, "
        f"{empty[1]:.1f} µs eager. Floor = (x read + y read and written + each distinct adapter's A and B once) / copy bandwidth. "
        "Graph timings replay CUDA graphs over rotating input sets with the L2 flushed before each replay; "
        "the PEFT loop runs eagerly as PEFT does. kernels = the family the ops pick (`use_gemv`; gemv: CUDA-core "
        "kernels, one program per token; dot: tensor-core kernels over tiles of a slot's tokens); other kernels = the "
        "other family on the same inputs. err = ‖ours − float32 oracle‖ / ‖oracle‖ on the update; n/c = not checked "
        "in this run (see notes). — = not run (memory budget, too many adapters for the loop, or eager timing of the "
        f"other family). Block shapes: {meta.get('adopted', 'defaults')}.",
        "### Targets\n\n" + targets(rows, bw, empty[0]),
        "### Shrink and expand apart\n\n" + splits(rows),
        "### All cases\n\n" + table(rows, bw),
    ]) + "\n"


def save(path: Path, rows: list[dict], meta: dict) -> None:
    keep = [{k: v for k, v in dataclasses.asdict(r["case"]).items()} | {k: v for k, v in r.items() if k != "case"} for r in rows]
    path.write_text(json.dumps({"meta": meta, "rows": keep}, indent=1))


def load(path: Path) -> tuple[list[dict], dict]:
    data = json.loads(path.read_text())
    rows = []
    for d in data["rows"]:
        case = Case(d.pop("hidden"), d.pop("rank"), d.pop("tokens"), d.pop("adapters"))
        rows.append({"case": case, **d})
    return rows, data["meta"]


def merge_section(path: Path, text: str) -> None:
    """Replace the LoRA kernels section of path in place (or append it), keeping the rest."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    out, skip, placed = [], False, False
    for line in old.splitlines(keepends=True):
        if line.rstrip("\n") == SECTION:
            skip, placed = True, True
            out.append(text.rstrip("\n") + "\n\n")
            continue
        if skip and line.startswith("## "):
            skip = False
        if not skip:
            out.append(line)
    body = "".join(out)
    path.write_text(body if placed else body.rstrip("\n") + "\n\n" + text)


# config sweep ------------------------------------------------------------


def _time_configs(case: Case, gen, downs: list, ups: list, block_m: int | None = None) -> tuple[list, list]:
    """Graph timings (µs per call) of shrink configs and expand configs on one case."""
    from adapterserve.kernels import build_adapter_meta

    lora, sets = make_sets(case, 4, gen)
    if block_m:
        for st in sets:
            st["meta"] = build_adapter_meta(st["slots"], st["meta"].num_slots, block_m)
    down_t = [graph_bench([_shrink_with(lora, st, cfg) for st in sets]) for cfg in downs]
    up_t = [graph_bench([_expand_with(lora, st, cfg) for st in sets]) for cfg in ups]
    return down_t, up_t


def sweep(gen: torch.Generator) -> tuple[str, dict]:
    """Block shapes on the target shapes; returns a table and the fastest knobs (summed over cases)."""
    from adapterserve.kernels import segment_ops as so

    D, U = so.DownConfig, so.UpConfig
    lines = ["| regime | knob | " + " | ".join(["case µs"] * 3) + " | sum |", "|---|---|---|---|---|---|"]
    best = {}
    # decode: CUDA-core kernels (rows, block_k, warps) and B elements per expand rank step;
    # 64 tokens on 64 rank-16 adapters, on 64 of mixed rank, on one rank-16 adapter
    dec = [Case(4096, 16, 64, 64), Case(4096, "mixed", 64, 64), Case(4096, 16, 64, 1)]
    downs = [D(0, bk, w, 1, r, True) for r in (2, 4, 8) for bk in (1024, 2048, 4096) for w in (4, 8)]
    up_knobs = [(e, w) for e in (8192, 16384, 32768) for w in (4, 8)]
    res = [_time_configs(c, gen, downs, [_gemv_up(c.max_rank, e, w) for e, w in up_knobs]) for c in dec]
    best["gemv_down"] = _pick_best(lines, "decode shrink", downs, [r[0] for r in res])
    best["gemv_up"] = _pick_best(lines, "decode expand (elems, warps)", up_knobs, [r[1] for r in res])
    # prefill: tensor-core lanes of the shrink and rank step of the expand
    pre = [Case(4096, 16, 4096, 128), Case(4096, 64, 4096, 128), Case(4096, "mixed", 4096, 128)]
    lanes = (16, 32, 64)
    res = [
        _time_configs(
            c, gen,
            [D(min(n, max(16, _p2(3 * c.max_rank))), 128 if n <= 32 else 64, 4, 4) for n in lanes],
            [U(min(n, max(16, _p2(c.max_rank))), 128, 4, 2, 512) for n in lanes],
        )
        for c in pre
    ]
    best["dot_lanes"] = _pick_best(lines, "prefill shrink lanes", list(lanes), [r[0] for r in res])
    best["dot_ranks"] = _pick_best(lines, "prefill expand rank step", list(lanes), [r[1] for r in res])
    return "\n".join(lines), best


def _gemv_up(max_rank: int, elems: int, warps: int):
    """The CUDA-core expand's blocks for `elems` B elements per rank step (as segment_ops.up_config)."""
    from adapterserve.kernels import segment_ops as so

    block_r = min(so.GEMV_UP_RANKS, _p2(max_rank))
    return so.UpConfig(block_r, min(so.GEMV_UP_COLUMNS, elems // block_r), warps, 1, 0, True)


def _p2(n: int) -> int:
    return 1 << max(1, (n - 1).bit_length())


def _pick_best(lines: list, regime: str, knobs: list, times: list[list[float]]):
    totals = [sum(t[i] for t in times) for i in range(len(knobs))]
    for i, knob in enumerate(knobs):
        cells = " | ".join(f"{t[i]:.1f}" for t in times) + " | —" * (3 - len(times))
        lines.append(f"| {regime} | {knob} | {cells} | {totals[i]:.1f} |")
    return knobs[min(range(len(knobs)), key=totals.__getitem__)]


def adopt(best: dict) -> str:
    """Use the fastest knobs for the grid; the same values must then be written into segment_ops."""
    from adapterserve.kernels import segment_ops as so

    so.GEMV_DOWN = best["gemv_down"]
    so.GEMV_UP_ELEMS, so.GEMV_UP_WARPS = best["gemv_up"]
    so.DOT_DOWN_LANES, so.DOT_UP_RANKS = best["dot_lanes"], best["dot_ranks"]
    return (
        f"ADOPTED GEMV_DOWN={so.GEMV_DOWN} GEMV_UP_ELEMS={so.GEMV_UP_ELEMS} GEMV_UP_WARPS={so.GEMV_UP_WARPS} "
        f"DOT_DOWN_LANES={so.DOT_DOWN_LANES} DOT_UP_RANKS={so.DOT_UP_RANKS}"
    )


def _configs(lora, family: str):
    """The block shapes the ops use for this layer in one kernel family."""
    from adapterserve.kernels import segment_ops as so

    if family == "dot":
        return so.dot_down_config(3 * lora.max_rank, True), so.dot_up_config(lora.max_rank, True)
    return so.gemv_down_config(lora.a.shape[2]), _gemv_up(lora.max_rank, so.GEMV_UP_ELEMS, so.GEMV_UP_WARPS)


def _shrink_with(lora, st, cfg):
    from adapterserve.kernels.segment_ops import seg_down

    return lambda: seg_down(st["x"], lora.a, 0, lora.rank, lora.row_start, st["meta"], st["v"], lora.max_rank, config=cfg)


def _expand_with(lora, st, cfg):
    from adapterserve.kernels.segment_ops import seg_up

    return lambda: seg_up(st["v"], lora.b, 0, lora.rank, lora.row_start, lora.out_offsets, st["meta"], st["y"], lora.max_rank, config=cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--md", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--section-out", type=Path, help="also write the section alone here")
    parser.add_argument("--json", type=Path, help="write raw results here")
    parser.add_argument("--render", type=Path, help="rebuild the section from a --json file (no GPU)")
    parser.add_argument("--quick", action="store_true", help="d=4096 and tokens 1/64/4096 only")
    parser.add_argument("--sweep", action="store_true", help="time block shapes on the target shapes and use the fastest")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cases after this many seconds")
    args = parser.parse_args()
    if args.render:
        rows, meta = load(args.render)
    else:
        rows, meta = measure(args)
    text = section(rows, meta)
    merge_section(args.md, text)
    if args.section_out:
        args.section_out.write_text(text)
    print(f"\n{meta['device']}\n\n" + table(rows, meta["bw"]) + "\n\n" + splits(rows) + "\n\n" + targets(rows, meta["bw"], meta["empty"][0]))


def measure(args) -> tuple[list[dict], dict]:
    import triton

    if not torch.cuda.is_available():
        sys.exit("benchmarks/lora_kernels.py needs a CUDA GPU")
    seed = int(torch.randint(1 << 31, (1,)))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, seed=seed,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        bw=copy_bandwidth(), empty=empty_launches(),
    )
    print(f"{meta['device']}: copy {meta['bw'] / 1e12:.2f} TB/s, two empty launches {meta['empty'][0]:.1f} µs graph "
          f"/ {meta['empty'][1]:.1f} µs eager, seed {seed}", flush=True)
    if args.sweep:
        lines, best = sweep(gen)
        meta["adopted"] = adopt(best)
        print(lines + "\n" + meta["adopted"], flush=True)
    rows, start, cases = [], time.monotonic(), grid(args.quick)
    for i, case in enumerate(cases):
        if time.monotonic() - start > args.budget_s:
            print(f"time budget spent: {len(cases) - i} cases not run", flush=True)
            break
        rows.append(run_case(case, gen, seed, split=i < 9))
        times = {k: round(v, 1) for k, v in rows[-1].items() if isinstance(v, float) and not k.startswith("err")}
        print(f"{case}: {times} floor {case.floor_bytes() / meta['bw'] * 1e6:.1f}", flush=True)
        torch.cuda.empty_cache()
        if args.json:
            save(args.json, rows, meta)
    return rows, meta


if __name__ == "__main__":
    main()
