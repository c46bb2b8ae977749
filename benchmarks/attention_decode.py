"""Paged decode attention: whole contexts against split contexts (split-KV), Llama-8B heads.

    PYTHONPATH=. python benchmarks/attention_decode.py [--sweep]

Cases: batch x context length (uniform, or "a-b": each sequence's length drawn from
a..b), 32 query / 8 KV heads, D=128, page 16, bf16, 64 keys per tile. For each, the
kernel with contexts whole (splits 1) in batch order and longest first (the engine's
launch order), with the split count `decode_splits` picks (default) and with other
counts, side by side (--sweep: tile shapes of whole contexts instead). Bytes counted: every context key and
value read once, queries read and outputs written once. Prints one table naming the
GPU; the copy bandwidth is measured in the same run.
"""
from __future__ import annotations

import sys

import torch
import triton.testing

from adapterserve.kernels.attention import decode_splits, paged_decode_attention

CASES = ((64, "640"), (64, "128-1152"), (256, "640"), (16, "2048"), (8, "4096"), (1, "4096"), (1, "16384"))
PAGE, HEADS, KV_HEADS, DIM = 16, 32, 8, 128


def _lengths(batch: int, spec: str) -> torch.Tensor:
    lo, _, hi = spec.partition("-")
    if not hi:
        return torch.full((batch,), int(lo), dtype=torch.int32)
    return torch.randint(int(lo), int(hi) + 1, (batch,), dtype=torch.int32)


def _case(batch: int, spec: str):
    lens = _lengths(batch, spec)
    pages = -(-int(lens.max()) // PAGE)
    table = torch.randperm(batch * pages, dtype=torch.int32).view(batch, pages).cuda()
    k = torch.randn(batch * pages * PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    moved = 2 * int(lens.sum()) * KV_HEADS * DIM * 2 + 2 * q.numel() * 2
    lens = lens.cuda()
    return (q, k, v, table, lens, torch.zeros_like(lens), PAGE), moved


SWEEP = [(n, w, st) for n in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3, 4)]


def sweep(copy_bw: float) -> None:
    """Tile shapes (keys per tile, warps, stages) of whole contexts launched longest first, at the
    batch sizes that keep contexts whole; the default first."""
    print("| B | context | keys/tile | warps | stages | ms | of copy |")
    print("|---|---|---|---|---|---|---|")
    for batch, spec in ((64, "128-1152"), (64, "640"), (256, "640")):
        args, moved = _case(batch, spec)
        out = torch.empty_like(args[0])
        order = torch.argsort(args[4], descending=True, stable=True).to(torch.int32)
        for n, w, st in [(64, 4, 2)] + [c for c in SWEEP if c != (64, 4, 2)]:
            fn = lambda: paged_decode_attention(*args, None, out, n, w, st, splits=1, order=order)  # noqa: E731
            try:
                ms = triton.testing.do_bench(fn, return_mode="median")
            except Exception as exc:  # a shape the card cannot run (shared memory): say so, go on
                print(f"| {batch} | {spec} | {n} | {w} | {st} | {type(exc).__name__} | - |")
                continue
            print(f"| {batch} | {spec} | {n} | {w} | {st} | {ms:.4f} | {moved / ms / 1e6 / copy_bw:.2f} |")


def main() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_bw = 2 * src.numel() / copy_ms / 1e6
    if "--sweep" in sys.argv:
        print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s (read+write)")
        sweep(copy_bw)
        return
    rows = []
    for batch, spec in CASES:
        args, moved = _case(batch, spec)
        out = torch.empty_like(args[0])
        default = decode_splits(batch, KV_HEADS, args[3].shape[1] * PAGE)
        order = torch.argsort(args[4], descending=True, stable=True).to(torch.int32)
        variants = [(1, None, "batch order"), (1, order, "longest first")]
        variants += [(n, None, "") for n in sorted({default, 2, 4, 16} if batch <= 16 else {default, 2, 4}) if n > 1]
        whole = None
        for splits, launch_order, label in variants:
            fn = lambda: paged_decode_attention(*args, None, out, splits=splits, order=launch_order)  # noqa: E731
            ms = triton.testing.do_bench(fn, return_mode="median")
            whole = whole or ms
            tag = ", ".join(t for t in (label, "default" if splits == default else "") if t)
            rows.append((batch, spec, splits, tag, ms, moved / ms / 1e6, whole / ms))
    print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s (read+write); bf16, 32/8 heads, D=128")
    print("| B | context | splits | | ms | GB/s | of copy | speed-up over whole, batch order |")
    print("|---|---|---|---|---|---|---|---|")
    for b, spec, splits, tag, ms, bw, gain in rows:
        print(f"| {b} | {spec} | {splits} | {tag} | {ms:.4f} | {bw:.0f} | {bw / copy_bw:.2f} | {gain:.2f} |")


if __name__ == "__main__":
    main()
