"""Paged decode attention: achieved bandwidth of tile shapes at Llama-8B decode sizes.

    PYTHONPATH=. python benchmarks/attention_decode.py

Bytes counted: every context key and value read once, queries read and outputs
written once. Prints one table naming the GPU; the copy bandwidth is measured in
the same run.
"""
from __future__ import annotations

import torch
import triton.testing

from adapterserve.kernels.attention import paged_decode_attention


def _case(batch: int, ctx: int, heads: int = 32, kv_heads: int = 8, dim: int = 128, page: int = 16):
    pages = -(-ctx // page)
    table = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    k = torch.randn(batch * pages * page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    start = torch.zeros_like(lens)
    moved = 2 * batch * ctx * kv_heads * dim * 2 + 2 * q.numel() * 2
    return (q, k, v, table, lens, start, page), moved


def main() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_bw = 2 * src.numel() / copy_ms / 1e6
    rows = []
    for batch, ctx in ((64, 640), (256, 640), (8, 4096)):
        args, moved = _case(batch, ctx)
        out = torch.empty_like(args[0])
        for block_n, warps, stages in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4)):
            fn = lambda: paged_decode_attention(*args, None, out, block_n, warps, stages)  # noqa: E731
            ms = triton.testing.do_bench(fn, return_mode="median")
            rows.append((batch, ctx, block_n, warps, stages, ms, moved / ms / 1e6))
    print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s (read+write)")
    print(f"{'B':>5}{'ctx':>6}{'block_n':>8}{'warps':>6}{'stages':>7}{'ms':>9}{'GB/s':>8}{'of copy':>8}")
    for b, c, n, w, s, ms, bw in rows:
        print(f"{b:>5}{c:>6}{n:>8}{w:>6}{s:>7}{ms:>9.3f}{bw:>8.0f}{bw / copy_bw:>8.2f}")


if __name__ == "__main__":
    main()
