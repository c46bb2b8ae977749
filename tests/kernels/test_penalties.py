"""The sampler's fused penalty kernel against its float32 reference twin: rows with their
own repetition, frequency and presence penalties, tables rows shared or distinct, every
combination of the three switched on."""
from __future__ import annotations

import itertools

import pytest
import torch

from adapterserve.kernels import reference

from .cases import NAN, fresh_generator, gpu, interpreted, needs_cuda

USES = list(itertools.product([False, True], repeat=3))


def _inputs(gen: torch.Generator, g: int, r: int, n: int, v: int, pattern: str):
    logits = torch.randn(g, v, generator=gen) * 5
    rows = torch.randperm(g, generator=gen)[:r]
    if pattern == "identical":
        table_rows = torch.full((r,), int(torch.randint(n, (1,), generator=gen)))
    else:
        table_rows = torch.randperm(n, generator=gen)[:r] if r <= n else torch.randint(n, (r,), generator=gen)
    counts = torch.randint(0, 4, (n, v), generator=gen, dtype=torch.int32) * (torch.rand(n, v, generator=gen) < 0.2)
    in_prompt = torch.rand(n, v, generator=gen) < 0.1
    params = torch.stack([torch.rand(n, generator=gen) * 2 + 0.5, torch.rand(n, generator=gen) * 4 - 2,
                          torch.rand(n, generator=gen) * 4 - 2], dim=1)
    return logits, rows, table_rows, counts.to(torch.int32), in_prompt, params


def _run(g, r, n, v, pattern, use, device):
    from adapterserve.kernels import penalties

    gen, seed = fresh_generator()
    logits, rows, table_rows, counts, in_prompt, params = _inputs(gen, g, r, n, v, pattern)
    want = torch.empty(r, v)
    reference.penalise_rows(logits, rows, table_rows, counts, in_prompt, params, use, want)
    on = [t.to(device) for t in (logits, rows, table_rows, counts, in_prompt, params)]
    got = torch.full((r, v), NAN, device=device)
    penalties.penalise_rows(*on, use, got)
    got = got.cpu()
    assert not torch.isnan(got).any(), f"NaN left in the output; seed={seed}"
    if device == "cpu":  # the interpreter rounds as torch does
        assert torch.equal(got, want), f"max diff {(got - want).abs().max():.3e}; seed={seed}"
    else:  # the GPU may contract x - f * c into one fused multiply-add
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-5), f"max diff {(got - want).abs().max():.3e}; seed={seed}"
    if use == (False, False, False):
        assert torch.equal(got, logits[rows]), f"no penalty must copy the row; seed={seed}"


@interpreted
@pytest.mark.parametrize("use", USES, ids=lambda u: "".join("rfp"[i] if on else "-" for i, on in enumerate(u)))
@pytest.mark.parametrize("pattern", ["distinct", "identical"])
def test_penalties_interpreted(use, pattern):
    _run(g=7, r=5, n=6, v=300, pattern=pattern, use=use, device="cpu")


@gpu
@needs_cuda
@pytest.mark.parametrize("use", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("g,r,v", [(64, 64, 128256), (256, 100, 32000), (3, 1, 4099)])
def test_penalties_gpu(use, g, r, v):
    _run(g=g, r=r, n=max(r, 8), v=v, pattern="distinct", use=use, device="cuda")
