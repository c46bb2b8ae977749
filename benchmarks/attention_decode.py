"""Paged decode attention: whole contexts against split contexts (split-KV), Llama-8B heads.

    PYTHONPATH=. python benchmarks/attention_decode.py [--sweep [--dots input] | --splits]

Cases: batch x context length (uniform, or "a-b": each sequence's length drawn from
a..b), 32 query / 8 KV heads, D=128, page 16, bf16, 64 keys per tile. For each, the
kernel with contexts whole (splits 1) in batch order and longest first (the engine's
launch order), with the split count `decode_splits` picks (default) and with other
counts, side by side, and whole contexts longest first (and every split count) with both
products on bf16 inputs (dots="input": tensor-core MMAs, the softmax weights rounded to bf16)
against float32 ones (--sweep: tile shapes of whole contexts instead, keys per tile, warps,
stages, and the loop: each tile's pages read in the tile (as it was) or a tile ahead (pipelined);
float32 products or, with --dots
input, bf16 ones; --splits: the engine's launch against contexts split in 2 and 4 parts, bf16 and FP8
caches). Bytes counted:
every context key and value read once, queries read and outputs written once. Every variant is timed
as the engine runs it, in a CUDA graph (of REPS launches, so the host's launch work is off the clock;
the cases' caches exceed L2 but the smallest); each figure is the least of three medians, the
variants of a case timed in turn. Prints one table naming the GPU; the copy
bandwidth is measured in the same run.
"""
from __future__ import annotations

import sys

import torch
import triton.testing

from adapterserve.kernels import attention
from adapterserve.kernels.attention import decode_blocks, decode_pipeline, decode_splits, paged_decode_attention
from adapterserve.kernels.kv_fp8 import quantize_kv
from benchmarks.measure import capture

CASES = ((64, "640"), (64, "128-1152"), (256, "640"), (16, "2048"), (8, "4096"), (1, "4096"), (1, "16384"))
PAGE, HEADS, KV_HEADS, DIM = 16, 32, 8, 128


def _lengths(batch: int, spec: str) -> torch.Tensor:
    lo, _, hi = spec.partition("-")
    if not hi:
        return torch.full((batch,), int(lo), dtype=torch.int32)
    return torch.randint(int(lo), int(hi) + 1, (batch,), dtype=torch.int32)


def decode_case(batch: int, spec: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    lens = _lengths(batch, spec)
    pages = -(-int(lens.max()) // PAGE)
    table = torch.randperm(batch * pages, dtype=torch.int32).view(batch, pages).to(device)
    k = torch.randn(batch * pages * PAGE, KV_HEADS, DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, DIM, device=device, dtype=dtype)
    moved = 2 * int(lens.sum()) * KV_HEADS * DIM * 2 + 2 * q.numel() * 2
    lens = lens.to(device)
    return (q, k, v, table, lens, torch.zeros_like(lens), PAGE), moved


def fp8_cache_case(args: tuple, moved: int) -> tuple[tuple, dict, int]:
    """The case's cache in e4m3 with its scales (kernels/kv_fp8.py), and the bytes it moves:
    each key and value at 1 byte plus its 4-byte scale per head."""
    q, k, v, table, lens, start, page = args
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    entries = (moved - 2 * q.numel() * 2) // 2  # keys and values read, as bf16 entries
    fp8_moved = entries + entries // DIM * 4 + 2 * q.numel() * 2
    return (q, kq, vq, table, lens, start, page), {"k_scale": ks, "v_scale": vs}, fp8_moved


# (keys per tile, warps, stages, loop): the engine's tiles first. Loops: "as it was" (each tile's pages read in
# the tile: no load in flight while a tile is computed), "pipelined" (read a tile ahead, kernels/attention.py
# PAGES_AHEAD: stages - 1 tiles in flight)
SWEEP = [(n, w, 2, "as it was") for n in (128, 64, 32) for w in (4, 8)]
SWEEP += [(n, w, st, "pipelined") for n in (128, 64, 32) for w in (4, 8) for st in (3, 4)]
SWEEP += [(64, 4, 5, "pipelined"), (32, 4, 5, "pipelined"), (32, 4, 6, "pipelined")]


def sweep(copy_bw: float, dots: str) -> None:
    """Tile shapes (keys per tile, warps, stages, loop) of whole contexts launched longest first,
    at the batch sizes that keep contexts whole, with ``dots`` products; the engine's first."""
    print("| B | context | keys/tile | warps | stages | loop | ms | of copy |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, spec in ((64, "128-1152"), (64, "640"), (256, "640")):
        args, moved = decode_case(batch, spec)
        out = torch.empty_like(args[0])
        order = torch.argsort(args[4], descending=True, stable=True).to(torch.int32)
        engine = (decode_blocks(batch, KV_HEADS, args[3].shape[1] * PAGE)[1], *decode_pipeline(), "engine's")
        for n, w, st, loop in [engine] + SWEEP:
            attention.PAGES_AHEAD = loop != "as it was"
            fn = lambda: paged_decode_attention(*args, None, out, n, w, st, splits=1, order=order,  # noqa: E731
                                                dots=dots)
            try:
                ms = _fastest_of_rounds([fn])[0]
            except Exception as exc:  # a shape the card cannot run (shared memory): say so, go on
                print(f"| {batch} | {spec} | {n} | {w} | {st} | {loop} | {type(exc).__name__} | - |")
                continue
            print(f"| {batch} | {spec} | {n} | {w} | {st} | {loop} | {ms:.4f} | {moved / ms / 1e6 / copy_bw:.2f} |")
        attention.PAGES_AHEAD = True


def split_launches(copy_bw: float) -> None:
    """Each case with the engine's launch (decode_blocks' tiles and splits, whole contexts longest
    first) and split into 2 and 4 parts, bf16 products, on a bf16 and an FP8 cache."""
    print("| B | context | cache | launch | ms | of copy | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for batch, spec in CASES:
        args, moved = decode_case(batch, spec)
        fp8_args, scales, fp8_moved = fp8_cache_case(args, moved)
        out = torch.empty_like(args[0])
        order = torch.argsort(args[4], descending=True, stable=True).to(torch.int32)
        for cache, case, kw, nbytes in (("bf16", args, {}, moved), ("fp8", fp8_args, scales, fp8_moved)):
            labels = ["engine's", "split 2", "split 4"]
            fns = [lambda: paged_decode_attention(*case, None, out, order=order, dots="input", **kw)]
            fns += [lambda s=s: paged_decode_attention(*case, None, out, splits=s, dots="input", **kw) for s in (2, 4)]
            times = _fastest_of_rounds(fns)
            for label, ms in zip(labels, times):
                print(f"| {batch} | {spec} | {cache} | {label} | {ms:.4f} | {nbytes / ms / 1e6 / copy_bw:.2f} "
                      f"| {times[0] / ms:.2f} |", flush=True)


ROUNDS = 3  # every variant of a case timed once a round; its fastest median kept
REPS = 8  # launches a variant's CUDA graph holds


def _fastest_of_rounds(fns: list) -> list[float]:
    """ms per call of each fn, each captured REPS times in a CUDA graph: the least of ROUNDS medians
    of a replay over REPS, the variants taken in turn each round (a disturbance of the card then
    touches one round of a variant, not all of its samples)."""
    graphs = [capture(lambda fn=fn: [fn() for _ in range(REPS)])[0] for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(ROUNDS):
        for i, graph in enumerate(graphs):
            best[i] = min(best[i], triton.testing.do_bench(graph.replay, return_mode="median") / REPS)
    return best


def main() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_bw = 2 * src.numel() / copy_ms / 1e6
    if "--sweep" in sys.argv:
        dots = sys.argv[sys.argv.index("--dots") + 1] if "--dots" in sys.argv else "float32"
        print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s (read+write); {dots} products")
        sweep(copy_bw, dots)
        return
    if "--splits" in sys.argv:
        print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s (read+write); bf16 products")
        split_launches(copy_bw)
        return
    rows = []
    for batch, spec in CASES:
        args, moved = decode_case(batch, spec)
        fp8_args, scales, fp8_moved = fp8_cache_case(args, moved)
        out = torch.empty_like(args[0])
        default = decode_splits(batch, KV_HEADS, args[3].shape[1] * PAGE)
        order = torch.argsort(args[4], descending=True, stable=True).to(torch.int32)
        variants = [(1, None, "batch order", "float32"), (1, order, "longest first", "float32"),
                    (1, order, "longest first, bf16 dots", "input")]
        for n in sorted({default, 2, 4, 16} if batch <= 16 else {default, 2, 4}):  # split contexts, both products
            variants += [(n, None, "", "float32"), (n, None, "bf16 dots", "input")] if n > 1 else []
        timed = [(splits, ", ".join(t for t in (label, "default" if splits == default else "") if t), moved,
                  lambda splits=splits, o=launch_order, dots=dots: paged_decode_attention(
                      *args, None, out, splits=splits, order=o, dots=dots))
                 for splits, launch_order, label, dots in variants]
        timed += [(default, "fp8 cache" + (", bf16 dots" if dots == "input" else ""), fp8_moved,  # the FP8 KV cache
                   lambda dots=dots: paged_decode_attention(*fp8_args, None, out, splits=default,
                                                            order=order if default == 1 else None, dots=dots, **scales))
                  for dots in ("float32", "input")]
        times = _fastest_of_rounds([fn for *_, fn in timed])
        for (splits, tag, nbytes, _), ms in zip(timed, times):
            rows.append((batch, spec, splits, tag, ms, nbytes / ms / 1e6, times[0] / ms))
    print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s (read+write); bf16, 32/8 heads, D=128")
    print("| B | context | splits | | ms | GB/s | of copy | speed-up over whole, batch order |")
    print("|---|---|---|---|---|---|---|---|")
    for b, spec, splits, tag, ms, bw, gain in rows:
        print(f"| {b} | {spec} | {splits} | {tag} | {ms:.4f} | {bw:.0f} | {bw / copy_bw:.2f} | {gain:.2f} |")


if __name__ == "__main__":
    main()
