"""RMSNorm / add+RMSNorm / SiLU-mul with the per-token e4m3 quantization fused in: the
usual output against the unfused op, its quantization bit for bit against the twin of
quantize_rows on that output. Interpreter on CPU (float32 / float16, e4m3 rounded by
torch from the kernel's float32 values), the real e4m3 store on a GPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels' @triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

from adapterserve.kernels.fp8 import quantize_rows_reference
from adapterserve.kernels.fp8_fused import rms_norm_quant, silu_mul_quant
from adapterserve.kernels.fp8_parts import silu_mul_quant_parts
from adapterserve.kernels.fused import silu_mul

E4M3 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]
Q_DTYPE = E4M3 if CUDA else torch.float32  # the interpreter's own float8 rounding is not the GPU's


def _bits(q):
    return q.to(E4M3).view(torch.uint8)


def _same_quantization(out, q, scale):
    q_ref, scale_ref = quantize_rows_reference(out)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(_bits(q), q_ref.view(torch.uint8))


def _unfused_norm(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_quant(dtype, add):
    x = (torch.randn(5, 200, device=DEVICE) * torch.logspace(-2, 2, 5, device=DEVICE)[:, None]).to(dtype)
    weight = (torch.rand(200, device=DEVICE) + 0.5).to(dtype)
    residual = torch.randn(5, 200, device=DEVICE).to(dtype) if add else None
    summed = (x.float() + residual.float()).to(dtype) if add else x
    out, q, scale = rms_norm_quant(x, weight, 1e-5, residual=residual, q_dtype=Q_DTYPE)
    if add:
        assert torch.equal(residual, summed)  # residual += x, in place
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), _unfused_norm(summed, weight, 1e-5).float(), rtol=tol, atol=tol)
    _same_quantization(out, q, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter, block", [(96, None), (2500, None), (2500, 1024)])  # one pass; the row loops
def test_silu_mul_quant(dtype, inter, block):
    gate_up = (torch.randn(4, 2 * inter, device=DEVICE) * 3).to(dtype)
    gate_up[2] = 0.0  # an all-zero row keeps zeros
    out, q, scale = silu_mul_quant(gate_up, q_dtype=Q_DTYPE, block=block)
    want = torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), want, rtol=tol, atol=tol)
    assert torch.equal(_bits(q)[2], torch.zeros(inter, dtype=torch.uint8, device=DEVICE))
    _same_quantization(out, q, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter, part", [(96, 16), (96, 128), (2500, 512), (2500, 4096)])
def test_silu_mul_quant_in_parts_is_the_one_pass_bit_for_bit(dtype, inter, part):
    """Two launches over parts of each row (the last part short, or one part for the row): the
    output, the scale and every quantized bit of the one-pass kernel's."""
    gate_up = (torch.randn(5, 2 * inter, device=DEVICE) * torch.logspace(-1, 1, 5, device=DEVICE)[:, None]).to(dtype)
    gate_up[2] = 0.0  # an all-zero row keeps zeros
    want = silu_mul_quant(gate_up, q_dtype=Q_DTYPE, part=0)
    got = silu_mul_quant(gate_up, q_dtype=Q_DTYPE, part=part)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert torch.equal(_bits(got[1]), _bits(want[1]))
    _same_quantization(*got)


@pytest.mark.parametrize("part", [0, 8, 100, -16])
def test_silu_mul_quant_parts_refuse_a_part_that_is_no_power_of_two_of_16_up(part):
    with pytest.raises(ValueError, match="part must be a power of two"):
        silu_mul_quant_parts(torch.zeros(2, 64, device=DEVICE), part, Q_DTYPE)


def test_cpu_twins_are_the_unfused_ops_then_quantize_rows():
    gate_up = torch.randn(3, 64)
    out, q, scale = silu_mul_quant(gate_up)  # a CPU tensor: the torch twin, real e4m3
    assert torch.equal(out, silu_mul(gate_up))
    assert q.dtype == E4M3 and scale.shape == (3, 1)
