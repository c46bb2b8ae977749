"""(IA)^3 Triton kernel against its float32 reference twin (bit-exact: one rounding each)."""
from __future__ import annotations

import pytest
import torch

from adapterserve.kernels import reference
from adapterserve.kernels.metadata import build_adapter_meta

from .cases import PATTERNS, fresh_generator, gpu, interpreted, needs_cuda, token_slots


def _run(pattern, t, s, n, dtype, device):
    from adapterserve.kernels import ia3

    gen, seed = fresh_generator()
    slots = token_slots(pattern, t, s, gen, no_adapter=0.25)
    x0 = torch.randn(t, n, generator=gen).to(dtype)
    scales = (torch.rand(s, n, generator=gen) * 2).to(dtype)
    x = x0.clone().to(device)
    ia3.ia3_scale(x, scales.to(device), build_adapter_meta(slots.to(device), s))
    ref = x0.clone()
    reference.ia3_scale(ref, scales, build_adapter_meta(slots, s))
    x = x.cpu()
    assert not torch.isnan(x).any(), f"NaN in output; seed={seed}"
    assert torch.equal(x[slots < 0], x0[slots < 0]), f"rows without adapter changed; seed={seed}"
    assert torch.equal(x, ref), f"max diff {(x.float() - ref.float()).abs().max():.3e}; seed={seed}"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("pattern,t,s,n", [(p, 19, 6, 300) for p in PATTERNS] + [("distinct", 5, 8, 7)])
def test_ia3_interpreted(pattern, t, s, n, dtype):
    _run(pattern, t, s, n, dtype, "cpu")


@gpu
@needs_cuda
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("t,n", [(64, 1024), (2048, 14336)])
def test_ia3_gpu_bf16(pattern, t, n):
    _run(pattern, t, 64, n, torch.bfloat16, "cuda")
