"""The base GEMMs of a Llama-shaped layer stack through cuBLAS and through cuBLASLt.

    PYTHONPATH=. python benchmarks/gemm_backend.py [--model 8b]

torch sends F.linear to cuBLAS or cuBLASLt (`torch.backends.cuda.preferred_blas_library`);
the engine leaves torch's choice (cuBLAS unless the user sets it). For each token count the script
times every layer's q|k|v, o, gate|up and down GEMMs (bf16, distinct weights per layer,
so nothing is served from L2) with each library, side by side: decode sizes as one
CUDA graph replay of the whole stack (how decode steps run), prefill sizes eagerly.
Prints one table naming the GPU, with the weights' read time at the copy bandwidth
(read + write bytes per second of a device copy) measured in the same run.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing

from benchmarks.checkpoints import SHAPES
from benchmarks.measure import copy_bandwidth, graph_ms

LIBRARIES = ("cublas", "cublaslt")
DECODE_TOKENS = (1, 16, 64, 256)
PREFILL_TOKENS = (1024, 4096, 8192)


def _layer_weights(shape, device: str) -> list[torch.Tensor]:
    """[N, K] bf16 weights of one layer's fused projections."""
    lin = shape.linear_shapes()  # kind -> (in, out)
    h, inter = shape.hidden, shape.inter
    dims = ((lin["q_proj"][1] + 2 * lin["k_proj"][1], h), (h, lin["o_proj"][0]), (2 * inter, h), (h, inter))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for n, k in dims]


def _stack(weights: list[list[torch.Tensor]], tokens: int) -> Callable[[], None]:
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], device="cuda", dtype=torch.bfloat16)
              for layer in weights for w in layer}

    def run() -> None:
        for layer in weights:
            for w in layer:
                F.linear(inputs[w.shape[1]], w)

    return run


def _time(weights, tokens: int, library: str) -> float:
    torch.backends.cuda.preferred_blas_library(library)
    run = _stack(weights, tokens)
    if tokens in DECODE_TOKENS:
        return graph_ms(run)
    return triton.testing.do_bench(run, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=0, help="layers in the stack (default: the model's)")
    args = p.parse_args()
    shape = SHAPES[args.model]
    layers = args.layers or shape.layers
    weights = [_layer_weights(shape, "cuda") for _ in range(layers)]
    weight_bytes = sum(w.numel() * 2 for layer in weights for w in layer)
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    initial = torch.backends.cuda.preferred_blas_library()
    rows = []
    for tokens in DECODE_TOKENS + PREFILL_TOKENS:
        times = {lib: _time(weights, tokens, lib) for lib in LIBRARIES}
        rows.append((tokens, times))
    torch.backends.cuda.preferred_blas_library(initial)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.model}: {layers} layers' q|k|v, o, "
          f"gate|up, down GEMMs, bf16; weights {weight_bytes / 1e9:.2f} GB, read at {bandwidth / 1e9:.0f} GB/s "
          f"in {weight_bytes / bandwidth * 1e3:.2f} ms")
    print("| tokens | timed as | cuBLAS ms | cuBLASLt ms | cuBLASLt / cuBLAS | cuBLASLt / weight read |")
    print("|---|---|---|---|---|---|")
    for tokens, t in rows:
        how = "graph replay" if tokens in DECODE_TOKENS else "eager"
        floor_ms = weight_bytes / bandwidth * 1e3
        print(f"| {tokens} | {how} | {t['cublas']:.3f} | {t['cublaslt']:.3f} | {t['cublaslt'] / t['cublas']:.3f} | "
              f"{t['cublaslt'] / floor_ms:.2f} |")


if __name__ == "__main__":
    main()
