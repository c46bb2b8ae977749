"""The FP8 base product against bf16 F.linear, per Llama-8B projection and token count.

    PYTHONPATH=. python benchmarks/fp8_gemm.py            # a GPU (scaled_mm needs sm_90)
    PYTHONPATH=. python benchmarks/fp8_gemm.py --smoke    # CPU, tiny shapes, seconds

Variants (layers.base_gemm): bf16 F.linear; scaled_mm (per-token e4m3 activations, one
quantization launch + torch._scaled_mm with row-wise scales); scaled_mm's GEMM alone
(activations quantized beforehand: what fusing the quantization into the preceding
RMSNorm could reach); w8a8 (the same arithmetic in the Triton W8A8 GEMM, tiles from
its chooser) and its GEMM alone; a sweep of the W8A8 GEMM's tiles (block_n x block_k,
split-K from the chooser, and the chooser's tiles without split-K), GEMM alone, so one
run shows the best choice per shape; weight_only (the Triton GEMM widening e4m3 weights
in its mainloop). "w8a8 err" is the W8A8 GEMM's relative error against scaled_mm's on
the same quantized input (the same arithmetic: float32 summation order only).
Each projection runs over enough distinct weight copies that L2 serves none of it; decode
token counts are timed as one CUDA graph replay of the chain (how decode steps run),
prefill eagerly. Every variant is warmed up (compiled, autotuned) before timing. The floor
is the weights' bytes at the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

from adapterserve.kernels.fp8 import quantize_rows
from adapterserve.kernels.fp8_gemm import fp8_weight_only_linear
from adapterserve.kernels.fp8_w8a8 import choose_w8a8_config, fp8_w8a8_linear
from adapterserve.layers.base_gemm import fp8_scaled_mm, fp8_w8a8
from adapterserve.models.fp8 import quantize_per_channel

PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N
TOKENS = (1, 16, 64, 256, 2048)
DECODE_MAX = 256
L2_BYTES = 50 << 20
MAIN = ("bf16", "scaled_mm", "scaled_mm gemm only", "w8a8", "w8a8 gemm only", "weight_only")
SWEEP = tuple(f"w8a8 n{bn} k{bk}" for bn in (64, 128) for bk in (128, 256)) + ("w8a8 split1",)
VARIANTS = MAIN + SWEEP


def _copies(k: int, n: int) -> int:
    return max(2, math.ceil(4 * L2_BYTES / (k * n)))  # fp8 bytes of all copies >= 4x L2


def _variant(name: str, x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
             ) -> Callable[[], None]:
    """One call of the chain: every copy's product. weights: (bf16 [N, K], e4m3 [N, K], scale [N])."""
    if name == "bf16":
        return lambda: [F.linear(x, w) for w, _, _ in weights]
    if name == "scaled_mm":
        return lambda: [fp8_scaled_mm(x, q, s) for _, q, s in weights]
    if name == "weight_only":
        return lambda: [fp8_weight_only_linear(x, q, s) for _, q, s in weights]
    if name == "w8a8":
        return lambda: [fp8_w8a8(x, q, s) for _, q, s in weights]
    xq, xs = quantize_rows(x)
    if name == "scaled_mm gemm only":
        return lambda: [torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=x.dtype)
                        for _, q, s in weights]
    config = _w8a8_config(name, x.shape[0], weights[0][1].shape[0], x.shape[1], x.device)
    return lambda: [fp8_w8a8_linear(xq, xs, q, s, x.dtype, config) for _, q, s in weights]


def _w8a8_config(name: str, m: int, n: int, k: int, device: torch.device):
    """The W8A8 tiles a variant names: the chooser's ("w8a8 gemm only"), a sweep point, or
    the chooser's without split-K."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    if name == "w8a8 split1":
        return choose_w8a8_config(m, n, k, sms, split_k=1)
    if name.startswith("w8a8 n"):
        bn, bk = (int(part[1:]) for part in name.split()[1:])
        return choose_w8a8_config(m, n, k, sms, block_n=bn, block_k=bk)
    return choose_w8a8_config(m, n, k, sms)


def _w8a8_error(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> float:
    """The W8A8 GEMM against torch._scaled_mm on the same quantized input (relative L2)."""
    xq, xs = quantize_rows(x)
    got = fp8_w8a8_linear(xq, xs, q, s, torch.float32)
    want = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.float32)
    return ((got - want).norm() / want.norm()).item()


def _time_ms(run: Callable[[], None], tokens: int, device: str) -> float:
    if device != "cuda":
        run()
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    from benchmarks.measure import graph_ms

    run()  # warm up: Triton compiles, cuBLAS picks its kernel
    torch.cuda.synchronize()
    return graph_ms(run) if tokens <= DECODE_MAX else triton.testing.do_bench(run, return_mode="median")


def _available(device: str) -> list[str]:
    if device != "cuda":  # CPU: the interpreter runs the Triton kernels
        return ["bf16", "w8a8", "w8a8 gemm only", "weight_only", "w8a8 split1"]
    if torch.cuda.get_device_capability() >= (9, 0):
        return list(VARIANTS)
    return ["bf16", "weight_only"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, two token counts, runs on CPU")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shrink, tokens_list = (64, (1, 16)) if args.smoke else (1, TOKENS)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    variants = _available(device)
    bandwidth = None
    if device == "cuda":
        from benchmarks.measure import copy_bandwidth

        bandwidth = copy_bandwidth("cuda", 1 << 30)
    rows = []
    for proj, (k, n) in PROJECTIONS.items():
        k, n = k // shrink, n // shrink
        copies = 2 if args.smoke else _copies(k, n)
        weights = []
        for _ in range(copies):
            w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            q, s = quantize_per_channel(w)
            weights.append((w, q, s))
        for tokens in tokens_list:
            x = torch.randn(tokens, k, device=device, dtype=dtype)
            times = {v: _time_ms(_variant(v, x, weights), tokens, device) / copies * 1e3 for v in variants}
            if "scaled_mm" in variants:
                times["w8a8 err"] = _w8a8_error(x, weights[0][1], weights[0][2])
            rows.append((proj, k, n, tokens, times))
        del weights
    _print(rows, variants, device, bandwidth, args.smoke)


def _print(rows, variants, device, bandwidth, smoke) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke: Triton interpreter, float32)"
    print(f"\n{name}; torch {torch.__version__}; Llama-8B projections{' / 64 (smoke)' if smoke else ''}; "
          f"us per projection; bandwidth {bandwidth / 1e9:.0f} GB/s" if bandwidth else f"\n{name}")
    ratios = [v for v in variants[1:] if v in MAIN]
    sweep = [v for v in variants if v in SWEEP]
    head = ["proj", "K->N", "M"] + [f"{v} us" for v in variants] + [f"{v} / bf16" for v in ratios]
    head += ["best w8a8 tiles"] if sweep else []
    head += ["w8a8 err"] if "scaled_mm" in variants else []
    if bandwidth:
        head += ["bf16 floor us", "fp8 floor us"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for proj, k, n, tokens, t in rows:
        cells = [proj, f"{k}->{n}", str(tokens)] + [f"{t[v]:.1f}" for v in variants]
        cells += [f"{t[v] / t['bf16']:.2f}" for v in ratios]
        if sweep:
            cells.append(min(sweep + ["w8a8 gemm only"], key=lambda v: t[v]))
        if "scaled_mm" in variants:
            cells.append(f"{t['w8a8 err']:.1e}")
        if bandwidth:
            cells += [f"{2 * k * n / bandwidth * 1e6:.1f}", f"{k * n / bandwidth * 1e6:.1f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
