"""Kernel choices that are not engine options yet, tried at the engine level: a workload
suffix patches the module attribute the engine calls, for that workload's engine only
(built, captured and run inside ``patched``), then puts it back.

    +sk            the FP8 decode GEMMs launched stream-K (kernels/decode_stream_k.py)
    +sp2/+sp4/+sp8 SiLU-mul+quant with each row over 2/4/8 programs (kernels/fp8_row_parts.py)
    +qp2/+qp4/+qp8 the row quantization of the products not fed by a fused op (o's input) likewise
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator

import torch

from adapterserve.kernels.fp8_row_parts import quantize_rows_parts, silu_mul_quant_parts


def _stream_k(config_of: Callable) -> Callable:
    def config(n: int, k: int):
        return dataclasses.replace(config_of(n, k), stream_k=True)
    return config


def _over_parts(kernel: Callable, parts: int) -> Callable[[Callable], Callable]:
    """The one-program-a-row op replaced by ``kernel`` over ``parts`` programs on CUDA tensors."""
    def wrap(one_program_a_row: Callable) -> Callable:
        def op(x: torch.Tensor):
            return kernel(x, parts) if x.is_cuda else one_program_a_row(x)
        return op
    return wrap


# suffix: (module, attribute, the replacement made from the original)
PATCHES: dict[str, tuple[str, str, Callable[[Callable], Callable]]] = {
    "+sk": ("adapterserve.kernels.decode_gemm", "fp8_decode_config", _stream_k),
    **{f"+sp{n}": ("adapterserve.models.decoder", "silu_mul_quant", _over_parts(silu_mul_quant_parts, n))
       for n in (2, 4, 8)},
    # layers.base_gemm.quantized_rows imports kernels.fp8.quantize_rows when it is called
    **{f"+qp{n}": ("adapterserve.kernels.fp8", "quantize_rows", _over_parts(quantize_rows_parts, n)) for n in (2, 4, 8)},
}


@contextlib.contextmanager
def patched(suffixes: tuple[str, ...]) -> Iterator[None]:
    """The patches of ``suffixes`` in place for the block, the originals restored after it."""
    undo = []
    try:
        for suffix in suffixes:
            module_name, attribute, make = PATCHES[suffix]
            module = importlib.import_module(module_name)
            original = getattr(module, attribute)
            undo.append((module, attribute, original))
            setattr(module, attribute, make(original))
        yield
    finally:
        for module, attribute, original in reversed(undo):
            setattr(module, attribute, original)
