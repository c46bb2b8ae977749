"""Paged prefill attention: the Triton kernel against the engine's former path
(gather + padded SDPA) and torch's flash varlen attention, at Llama-8B heads.

    PYTHONPATH=. python3 benchmarks/prefill_attention.py              # GPU, bfloat16
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/prefill_attention.py --smoke   # CPU, tiny

Per workload, one layer's attention over a paged cache (page 16, pages in random
order): 32 query heads, 8 kv heads, head dim 128. Metadata (tile lists, padded
views) is built once per step and not timed; the padded path's per-layer gather
is timed. Flash varlen (torch.nn.attention.varlen, where this torch has it)
reads contiguous packed K/V gathered beforehand, untimed: it skips the paging;
where varlen_attn takes no enable_gqa (torch 2.11), K/V are repeated to the query
heads. Medians of triton.testing.do_bench; `err` is each output's relative error
against the float32 twin; `MiB` the peak memory a call allocates beyond its
inputs and preallocated output. Prints one table naming the device; --sweep adds
one of the kernel's tile shapes.
"""
from __future__ import annotations

import argparse
import inspect
import time
from dataclasses import dataclass

import numpy as np
import torch

from adapterserve.kernels import build_prefill_tiles, reference
from adapterserve.kernels.prefill_attention import paged_prefill_attention
from benchmarks.padded_attention import padded_attention, padded_views

PAGE = 16
# name -> [(new tokens, cached before), ...]
WORKLOADS = {
    "16 x 512 prefill": [(512, 0)] * 16,
    "4 x 1024 prefill + 60 decode @640": [(1024, 0)] * 4 + [(1, 639)] * 60,
    "1 x 4096 prefill": [(4096, 0)],
}
SMOKE = {
    "2 x 24 prefill": [(24, 0)] * 2,
    "1 x 20 prefill + 3 decode @30": [(20, 0)] + [(1, 29)] * 3,
    "1 x 40 prefill": [(40, 0)],
}

SWEEP = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3),
         (128, 64, 8, 2), (128, 128, 4, 2), (128, 128, 8, 2), (256, 64, 8, 2)]


@dataclass
class Shape:
    heads: int
    kv_heads: int
    dim: int
    dtype: torch.dtype
    device: str


class Step:
    """Packed queries and a paged cache holding every sequence's context."""

    def __init__(self, seqs: list[tuple[int, int]], shape: Shape) -> None:
        self.counts = np.array([n for n, _ in seqs], dtype=np.int32)
        self.lens = np.array([n + c for n, c in seqs], dtype=np.int32)
        pages = -(-self.lens // PAGE)
        dev, dt = shape.device, shape.dtype
        perm = torch.randperm(int(pages.sum()), device=dev, dtype=torch.int32)
        self.tables = torch.zeros(len(seqs), int(pages.max()), dtype=torch.int32, device=dev)
        for b, first in enumerate(np.cumsum(pages) - pages):
            self.tables[b, : pages[b]] = perm[first : first + pages[b]]
        slots = int(pages.sum()) * PAGE
        self.k = torch.randn(slots, shape.kv_heads, shape.dim, dtype=dt, device=dev)
        self.v = torch.randn_like(self.k)
        self.q = torch.randn(int(self.counts.sum()), shape.heads, shape.dim, dtype=dt, device=dev)
        self.lens_t = torch.from_numpy(self.lens).to(dev)
        self.starts = torch.zeros_like(self.lens_t)
        self.cu = torch.from_numpy(np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int32)).to(dev)

    def paged_args(self) -> tuple:
        tiles = build_prefill_tiles(self.counts, self.lens, torch.device(self.q.device))
        return self.q, self.k, self.v, self.tables, self.lens_t, self.starts, self.cu, tiles, PAGE, None

    def packed_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contiguous K/V of all sequences, back to back, and their cu_seqlens."""
        slots = torch.cat([self._slots(b) for b in range(len(self.lens))])
        cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int32)).to(self.q.device)
        return self.k[slots], self.v[slots], cu_k

    def _slots(self, b: int) -> torch.Tensor:
        j = torch.arange(int(self.lens[b]), device=self.q.device)
        return self.tables[b, j // PAGE].long() * PAGE + j % PAGE


def triton_fn(step: Step, **tuning):
    args, out = step.paged_args(), torch.empty_like(step.q)
    return lambda: paged_prefill_attention(*args, out, **tuning) or out


def padded_fn(step: Step):
    views = padded_views(step.counts, step.lens, step.starts, step.tables, PAGE, None)
    return lambda: padded_attention(step.q, step.k, step.v, views)


def varlen_fn(step: Step):
    """torch's flash varlen attention (None where this torch or device lacks it)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if not step.q.is_cuda:
        return None
    params = inspect.signature(varlen_attn).parameters
    keys, values, cu_k = step.packed_kv()
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        group = step.q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    max_q, max_k = int(step.counts.max()), int(step.lens.max())
    return lambda: varlen_attn(step.q, keys, values, step.cu, cu_k, max_q, max_k, **kwargs)


def median_ms(fn, on_gpu: bool) -> float:
    if on_gpu:
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run_method(make, step: Step, want: torch.Tensor) -> tuple[float, float, float] | None:
    """(ms, relative error, peak extra MiB) of one method, or None if unavailable."""
    try:
        fn = make(step)
    except (RuntimeError, TypeError, ValueError) as exc:  # a baseline this torch cannot run becomes n/a
        print(f"  {make.__name__}: {type(exc).__name__}: {exc}")
        return None
    if fn is None:
        return None
    on_gpu = step.q.is_cuda
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if on_gpu else 0
    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if on_gpu else float("nan")
    err = float((out.float() - want).norm() / want.norm())
    return median_ms(fn, on_gpu), err, peak


def reference_out(step: Step) -> torch.Tensor:
    want = torch.empty(step.q.shape, dtype=torch.float32, device=step.q.device)
    reference.paged_prefill_attention(*step.paged_args(), want)
    return want


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in float32 on the CPU (interpreter)")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tile shapes")
    args = parser.parse_args()
    if args.smoke:
        shape, workloads, device_name = Shape(4, 2, 16, torch.float32, "cpu"), SMOKE, "CPU (Triton interpreter)"
    else:
        shape, workloads, device_name = Shape(32, 8, 128, torch.bfloat16, "cuda"), WORKLOADS, torch.cuda.get_device_name()
    torch.manual_seed(0)
    rows = []
    for name, seqs in workloads.items():
        step = Step(seqs, shape)
        want = reference_out(step)
        results = [run_method(make, step, want) for make in (triton_fn, padded_fn, varlen_fn)]
        rows.append((name, int(step.counts.sum()), results))
        print(f"  done: {name}", flush=True)
    print_table(device_name, shape, rows)
    if args.sweep:
        sweep(workloads, shape)


def sweep(workloads: dict, shape: Shape) -> None:
    """Triton ms per (block_m, block_n, num_warps, num_stages) of the multi-token launch."""
    print(f"\n{'workload':<36}{'block_m':>8}{'block_n':>8}{'warps':>6}{'stages':>7}{'ms':>9}")
    for name, seqs in workloads.items():
        step = Step(seqs, shape)
        for block_m, block_n, warps, stages in SWEEP:
            fn = triton_fn(step, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
            ms = median_ms(fn, step.q.is_cuda)
            print(f"{name:<36}{block_m:>8}{block_n:>8}{warps:>6}{stages:>7}{ms:>9.3f}", flush=True)


def print_table(device_name: str, shape: Shape, rows) -> None:
    print(f"\n{device_name}; Hq {shape.heads}, Hkv {shape.kv_heads}, D {shape.dim}, {shape.dtype}, page {PAGE}")
    head = f"{'workload':<36}{'tokens':>7}{'triton ms':>10}{'padded ms':>10}{'varlen ms':>10}"
    print(head + f"{'padded/tri':>11}{'varlen/tri':>11}{'err tri/pad/var':>22}{'MiB tri/pad/var':>20}")
    for name, tokens, (tri, pad, var) in rows:
        errs = "/".join(_cell(r, 1, ".0e") for r in (tri, pad, var))
        mib = "/".join(_cell(r, 2, ".0f") for r in (tri, pad, var))
        print(f"{name:<36}{tokens:>7}{_cell(tri, 0, '.3f'):>10}{_cell(pad, 0, '.3f'):>10}{_cell(var, 0, '.3f'):>10}"
              f"{_ratio(pad, tri):>11}{_ratio(var, tri):>11}{errs:>22}{mib:>20}")


def _cell(result, index: int, fmt: str) -> str:
    return "n/a" if result is None else format(result[index], fmt)


def _ratio(other, triton_result) -> str:
    return "n/a" if other is None or triton_result is None else f"{other[0] / triton_result[0]:.2f}"


if __name__ == "__main__":
    main()
