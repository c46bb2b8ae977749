"""Bottleneck adapter Triton kernel against its float32 reference twin: each slot its own
width and activation ("mixed": a random activation per slot, all in one launch)."""
from __future__ import annotations

import pytest
import torch

from adapterserve.kernels import reference
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.segment_common import ACT_CODES
from adapterserve.kernels.segment_ops import GEMV_MAX_RANK, GEMV_TOKENS

from .cases import NAN, PATTERNS, check_close, fresh_generator, gpu, interpreted, needs_cuda, token_slots

ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "tanh")
# (pattern, T, S, D, R, activation, share without adapter)
CPU_CASES = [
    ("identical", 40, 3, 50, 24, "relu", 0.0),
    ("distinct", 10, 12, 40, 16, "gelu", 0.0),
    ("uniform", 24, 5, 70, 48, "gelu_new", 0.2),
    ("zipf", 30, 6, 33, 70, "silu", 0.1),
    ("skewed", 30, 4, 64, 20, "tanh", 0.0),
    ("none", 12, 3, 40, 16, "relu", 0.0),
    ("uniform", 300, 4, 24, 16, "gelu", 0.1),  # past GEMV_TOKENS: tensor-core kernels
    ("distinct", 12, 12, 40, 16, "mixed", 0.1),
    ("uniform", 300, 6, 24, 16, "mixed", 0.0),
]
GPU_CASES = [(p, 64, 32, 4096, 256, "relu", 0.1) for p in PATTERNS] + [
    ("zipf", 2048, 32, 4096, 256, "gelu", 0.1),
    ("uniform", 1024, 16, 4096, 64, "silu", 0.0),
    ("skewed", 512, 8, 768, 48, "gelu_new", 0.2),
    ("distinct", 32, 32, 2048, 128, "tanh", 0.0),
    ("uniform", 16, 8, 768, 48, "gelu_new", 0.1),  # CUDA-core kernels with bias and activation
    ("distinct", 64, 64, 4096, 64, "mixed", 0.1),
    ("zipf", 1024, 16, 4096, 64, "mixed", 0.0),
]
# the mixed input (pre-LN decoders): decode batches on the CUDA-core kernels, the 8B's width
MIXED_GPU_CASES = [(p, 64, 32, 4096, GEMV_MAX_RANK, "mixed", 0.1) for p in PATTERNS] + [
    c for c in GPU_CASES if c[1] <= GEMV_TOKENS and c[4] <= GEMV_MAX_RANK]


def _weights(s: int, d: int, r: int, gen: torch.Generator):
    """Per-slot widths (some 0, some full); rows past a slot's width are NaN."""
    rank = torch.randint(0, r + 1, (s,), generator=gen, dtype=torch.int32)
    rank[torch.randint(s, (1,), generator=gen)] = r
    down = torch.randn(s, r, d, generator=gen) / d**0.5
    up = torch.randn(s, r, d, generator=gen) / r**0.5
    down_bias = torch.randn(s, r, generator=gen) * 0.1
    up_bias = torch.randn(s, d, generator=gen) * 0.1
    unused = torch.arange(r)[None, :] >= rank[:, None].long()
    down[unused], up[unused], down_bias[unused] = NAN, NAN, NAN
    return down, down_bias, up, up_bias, rank


def _codes(act: str, s: int, gen: torch.Generator) -> torch.Tensor:
    """[S] int32 activation codes: every slot ``act``'s, or ("mixed") each slot one at random."""
    if act != "mixed":
        return torch.full((s,), ACT_CODES[act], dtype=torch.int32)
    names = torch.randint(len(ACTIVATIONS), (s,), generator=gen)
    return torch.tensor([ACT_CODES[ACTIVATIONS[i]] for i in names.tolist()], dtype=torch.int32)


def _run(case, dtype, device, mixed: bool = False):
    """One launch against the reference; mixed: the pre-LN decoders' form, the input read from
    out itself plus each slot's ln_mix (0, 1 or a fraction) times a residual."""
    from adapterserve.kernels import bottleneck

    pattern, t, s, d, r, act, no_adapter = case
    gen, seed = fresh_generator()
    down, down_bias, up, up_bias, rank = _weights(s, d, r, gen)
    codes = _codes(act, s, gen)
    slots = token_slots(pattern, t, s, gen, no_adapter)
    h = torch.randn(t, d, generator=gen)
    out0 = torch.randn(t, d, generator=gen).to(dtype)
    residual = torch.randn(t, d, generator=gen).to(dtype)
    ln_mix = torch.tensor([0.0, 1.0, 0.37])[torch.randint(3, (s,), generator=gen)].to(dtype)
    ws = torch.full((t, r), NAN, dtype=dtype, device=device)
    out = out0.clone().to(device)
    args = [w.to(device, dtype) for w in (h, down, down_bias, up, up_bias)]
    meta = build_adapter_meta(slots.to(device), s)
    if mixed:
        args[0] = out
        extra = (residual.to(device), ln_mix.to(device))
    bottleneck.bottleneck_adapter(*args, rank.to(device), codes.to(device), meta, ws, out, *(extra if mixed else ()))
    ref_ws = torch.full((t, r), NAN)
    ref = out0.float().clone()
    cpu = [w.to(dtype).float() for w in (h, down, down_bias, up, up_bias)]
    if mixed:
        cpu[0] = ref
    reference.bottleneck_adapter(*cpu, rank, codes, build_adapter_meta(slots, s), ref_ws, ref,
                                 *((residual.float(), ln_mix.float()) if mixed else ()))
    slot_rank = torch.where(slots >= 0, rank[slots.long().clamp(min=0)], 0)
    defined = torch.arange(r)[None, :] < slot_rank[:, None]
    ws, out, touched = ws.cpu(), out.cpu(), slot_rank > 0
    check_close(ws[defined], ref_ws[defined], dtype, seed, f"bottleneck workspace {case}")
    assert torch.isnan(ws[~defined]).all(), f"workspace written past a slot's width; seed={seed}"
    assert torch.equal(out[~touched], out0[~touched]), f"rows without adapter changed; seed={seed}"
    delta, ref_delta = (out.double() - out0.double())[touched], (ref.double() - out0.double())[touched]
    check_close(delta, ref_delta, dtype, seed, f"bottleneck out {case}")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_bottleneck_interpreted(case, dtype):
    _run(case, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in CPU_CASES if c[1] <= GEMV_TOKENS and c[4] <= GEMV_MAX_RANK], ids=str)
def test_mixed_input_interpreted(case, dtype):
    _run(case, dtype, "cpu", mixed=True)


@interpreted
def test_mixed_input_needs_the_cuda_core_kernel():
    from adapterserve.kernels import bottleneck

    t, d = GEMV_TOKENS + 1, 8
    meta = build_adapter_meta(torch.zeros(t, dtype=torch.int32), 1)
    w, x = torch.zeros(1, 4, d), torch.zeros(t, d)
    with pytest.raises(ValueError, match="CUDA-core"):
        bottleneck.bottleneck_adapter(x, w, torch.zeros(1, 4), w, torch.zeros(1, d), torch.ones(1, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), meta, torch.zeros(t, 4), x, torch.zeros(t, d),
                                      torch.ones(1))


@interpreted
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_each_activation(act):
    _run(("uniform", 16, 3, 24, 16, act, 0.0), torch.float32, "cpu")


@interpreted
@pytest.mark.parametrize("codes", [torch.ones(2, dtype=torch.int32), torch.ones(1, dtype=torch.int64)], ids=["shape", "dtype"])
def test_activation_codes_must_be_one_int32_per_slot(codes):
    from adapterserve.kernels import bottleneck

    meta = build_adapter_meta(torch.zeros(2, dtype=torch.int32), 1)
    w = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="activation"):
        bottleneck.bottleneck_adapter(
            torch.zeros(2, 8), w, torch.zeros(1, 4), w, torch.zeros(1, 8), torch.ones(1, dtype=torch.int32),
            codes, meta, torch.zeros(2, 4), torch.zeros(2, 8),
        )


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_bottleneck_gpu_bf16(case):
    _run(case, torch.bfloat16, "cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("case", MIXED_GPU_CASES, ids=str)
def test_mixed_input_gpu_bf16(case):
    _run(case, torch.bfloat16, "cuda", mixed=True)
