"""FP8 base-product kernels against float32 torch: per-token activation quantization, the
weight-only Triton GEMM (under the interpreter on CPU), the dequantizing reference; on a
GPU also torch._scaled_mm with per-token activations. Fresh random inputs each run."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels' @triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

from adapterserve.kernels.fp8 import quantize_rows_reference, quantize_rows_triton
from adapterserve.kernels.fp8_gemm import fp8_weight_only_linear
from adapterserve.kernels.fp8_w8a8 import choose_w8a8_config, fp8_w8a8_linear
from adapterserve.layers import base_gemm
from adapterserve.layers.base_gemm import (
    base_linear,
    fp8_kernel_for,
    fp8_linear,
    fp8_linear_oracle,
    fp8_linear_reference,
    resolve_fp8_gemm,
)

E4M3 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# CPU tensors through Triton's interpreter (set only without CUDA); the gpu-marked twins cover CUDA
interpreter = pytest.mark.skipif(CUDA, reason="Triton's CPU interpreter: the gpu-marked tests run on CUDA")
# one projection through e4m3 weights (3 mantissa bits, per-channel scales) against the
# unquantized float32 product: about 0.027 relative L2 error for Gaussian weights
LAYER_REL_TOL = 0.04


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _quantized_weight(n, k, device="cpu"):
    w = torch.randn(n, k, device=device) / k**0.5
    scale = w.abs().amax(dim=1) / 448.0
    return w, (w / scale[:, None]).to(E4M3), scale


def _dequantized(q, scale):
    return q.float() * scale[:, None]


@interpreter
@pytest.mark.parametrize("k, block", [(300, None), (2500, None), (2500, 1024)])  # one pass; the row loops
def test_quantize_rows_triton_matches_the_twin(k, block):
    x = torch.randn(6, k) * torch.logspace(-3, 2, 6)[:, None]
    x[3] = 0.0  # an all-zero row keeps zeros
    # float32 output under the interpreter (its float8 rounding differs from the GPU's
    # round-to-nearest-even); rounded here by torch, it must equal the twin bit for bit
    q, scale = quantize_rows_triton(x, out_dtype=torch.float32, block=block)
    q_ref, scale_ref = quantize_rows_reference(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.to(E4M3).view(torch.uint8), q_ref.view(torch.uint8))
    assert q.abs().max() <= 448.0 and not torch.isnan(q).any()


def test_quantize_rows_reference_is_within_e4m3_rounding():
    x = torch.randn(9, 257) * 5
    q, scale = quantize_rows_reference(x)
    assert q.dtype == E4M3 and scale.shape == (9, 1)
    back = q.float() * scale
    assert (back - x).abs().le(x.abs() / 16 + scale * 2.0**-9).all()  # 3 mantissa bits; subnormal floor
    assert (q.float().abs().amax(dim=1) == 448.0).all()  # each row's absmax uses the whole e4m3 range


@interpreter
@pytest.mark.parametrize("m", [1, 7, 40, 100])  # each tile shape of _tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_only_gemm_matches_float32(m, dtype):
    _, q, scale = _quantized_weight(70, 300)  # N, K not multiples of the blocks
    x = torch.randn(m, 300).to(dtype)
    y = fp8_weight_only_linear(x, q, scale)
    want = x.float() @ _dequantized(q, scale).T
    assert y.dtype == dtype and y.shape == (m, 70)
    assert _rel(y, want) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_reference_path_is_the_dequantized_product_and_near_the_float_one():
    w, q, scale = _quantized_weight(96, 128)
    x, bias = torch.randn(5, 128), torch.randn(96)
    y = base_linear(x, q, scale, bias)
    assert _rel(y, x @ _dequantized(q, scale).T + bias) < 1e-6
    assert 0 < _rel(y - bias, x @ w.T) < LAYER_REL_TOL
    assert torch.equal(base_linear(x, w, None, bias), torch.nn.functional.linear(x, w, bias))


def test_kernel_choice():
    assert resolve_fp8_gemm("auto", torch.device("cpu")) == "reference"
    assert resolve_fp8_gemm("weight_only", torch.device("cpu")) == "reference"  # CPU runs the reference
    assert resolve_fp8_gemm("scaled_mm", torch.device("cpu")) == "scaled_mm"  # emulated in float32
    assert resolve_fp8_gemm("decode_w8a8", torch.device("cpu")) == "decode_w8a8"  # emulated in float32
    assert resolve_fp8_gemm("decode_weight_only", torch.device("cpu")) == "reference"
    cuda = torch.device("cuda", 0)  # the decode kernels take up to 64 rows, scaled_mm the rest
    assert [resolve_fp8_gemm("decode_w8a8", cuda, t) for t in (1, 64, 65)] == ["decode_w8a8"] * 2 + ["scaled_mm"]
    assert resolve_fp8_gemm("decode_weight_only", cuda, 64) == "decode_weight_only"
    assert resolve_fp8_gemm("decode_weight_only", cuda, 65) == "scaled_mm"
    with pytest.raises(ValueError, match="fp8_gemm must be one of"):
        resolve_fp8_gemm("cutlass", torch.device("cpu"))


@pytest.mark.parametrize("capability, decode, prefill", [((9, 0), "decode_w8a8", "scaled_mm"),
                                                         ((8, 9), "weight_only", "weight_only")])
def test_auto_kernel_per_device(monkeypatch, capability, decode, prefill):
    """auto: on Hopper our decode GEMM (W8A8) for decode batches, scaled_mm above; elsewhere on CUDA
    the weight-only GEMM. A weight past the decode GEMM's 32-bit offsets takes w8a8_triton."""
    monkeypatch.setattr(base_gemm, "_capability", lambda index: capability)
    cuda, weight = torch.device("cuda", 0), torch.empty(96, 128, dtype=torch.float8_e4m3fn)
    assert [fp8_kernel_for("auto", cuda, t, weight) for t in (1, 64, 65, 4096)] == [decode] * 2 + [prefill] * 2
    monkeypatch.setattr(base_gemm, "INDEX_LIMIT", weight.numel())
    assert fp8_kernel_for("auto", cuda, 64, weight) == ("w8a8_triton" if decode == "decode_w8a8" else decode)
    assert fp8_kernel_for("decode_w8a8", torch.device("cpu"), 64, weight) == "decode_w8a8"  # CPU: emulated


# GPU: bfloat16 activations, 8B-like aspect at small size

def _with_ties(x: torch.Tensor) -> torch.Tensor:
    """Rows whose absmax is 448 * 2^j (an exact scale) holding e4m3 rounding midpoints
    (1 + 1/16 and 3 + 1/8 tie to even downwards, 1 + 3/16 upwards) and values a rounding error off them."""
    x = x.clone()
    midpoints = torch.tensor([1.0625, -1.1875, 3.125, 448.0, 0.0078125 * 1.0625])
    for row in range(0, x.shape[0], 3):
        x[row] = torch.randn(x.shape[1], dtype=x.dtype, device=x.device).clamp(-400, 400)
        x[row, :5] = midpoints.to(x.dtype) * 2.0**-3
        x[row, 5:9] = (midpoints[[0, 1, 2, 4]] * (1 + 2.0**-7)).to(x.dtype) * 2.0**-3
    return x


@interpreter
@pytest.mark.parametrize("k, block", [(300, None), (2500, None), (2500, 1024)])  # one pass; the row loops
def test_quantize_rows_triton_rounds_midpoints_as_the_twin(k, block):
    x = _with_ties(torch.randn(6, k))
    q, scale = quantize_rows_triton(x, out_dtype=torch.float32, block=block)
    q_ref, scale_ref = quantize_rows_reference(x)
    assert torch.equal(scale, scale_ref) and scale[0].item() == 2.0**-3  # absmax 56 = 448 / 8
    assert torch.equal(q.to(E4M3).view(torch.uint8), q_ref.view(torch.uint8))
    assert q_ref[0, :3].float().tolist() == [1.0, -1.25, 3.0]  # ties to even


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [33, 1024])
@pytest.mark.parametrize("block", [None, 1024])  # one pass; the row loops
def test_quantize_rows_on_gpu_is_the_twin_bit_for_bit(rows, block):
    """Same float32 arithmetic in kernel and twin (IEEE divisions, then round to nearest
    even): equal bits, midpoints and near-midpoints included."""
    for _ in range(4):  # fresh inputs: a rare differing rounding shows up in some draw
        x = _with_ties(torch.randn(rows, 4096, device="cuda") * 4).to(torch.bfloat16)
        q, scale = quantize_rows_triton(x, block=block)
        q_ref, scale_ref = quantize_rows_reference(x)
        assert torch.equal(scale, scale_ref)
        differ = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
        assert differ.numel() == 0, [(tuple(i), x[tuple(i)].item(), scale[i[0]].item()) for i in differ[:5].tolist()]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256])
@pytest.mark.parametrize("kernel", ["scaled_mm", "w8a8_triton", "weight_only", "decode_w8a8", "decode_weight_only"])
def test_fp8_kernels_on_gpu_against_the_reference(m, kernel):
    """weight_only: the same weights, bf16 rounding only (rel < 1e-2); scaled_mm also rounds
    the activations to e4m3 per token (rel < LAYER_REL_TOL). The decode kernels hand batches
    above 64 rows to scaled_mm."""
    if kernel != "weight_only" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled_mm and e4m3 tl.dot need sm_90")
    _, q, scale = _quantized_weight(1536, 1024, "cuda")
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    ran = resolve_fp8_gemm(kernel, x.device, m)
    want = fp8_linear_reference(x.float(), q, scale)
    got = fp8_linear(x, q, scale, kernel)
    assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    assert _rel(got, want) < (1e-2 if "weight_only" in ran else LAYER_REL_TOL)
    if "weight_only" not in ran:  # against its own arithmetic: bf16 output rounding only
        assert _rel(got, fp8_linear_oracle(x, q, scale, ran)) < 5e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (28672, 1024)])  # split-K and not
def test_w8a8_triton_on_gpu_matches_scaled_mm_on_8b_shapes(m, n, k):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("e4m3 tl.dot and row-wise scaled_mm need sm_90")
    _, q, scale = _quantized_weight(n, k, "cuda")
    xq, x_scale = quantize_rows_triton(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    want = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.float32)
    for _ in range(3):  # the counters reset after each call
        got = fp8_w8a8_linear(xq, x_scale, q, scale, torch.float32)
        # Triton's e4m3 dot on Hopper accumulates in the tensor cores' reduced-precision fp8
        # accumulator (not promoted to float32 every few K steps as cuBLAS does): measured up
        # to 1.2e-3 relative at K = 4096-14336 on an H100; a wrong scale or layout gives ~1
        assert _rel(got, want) < W8A8_ACCUMULATION_TOL and not torch.isnan(got).any()


W8A8_ACCUMULATION_TOL = 3e-3


def _w8a8_twin(xq, x_scale, q, scale):
    return (xq.double() @ q.double().T * x_scale.double() * scale.double()[None, :]).float()


@interpreter
@pytest.mark.parametrize("m", [1, 5, 33])  # row blocks 16, 64
@pytest.mark.parametrize("split_k", [1, 3])  # the last split's sum, a split with a ragged K end
def test_w8a8_triton_gemm_matches_float32(m, split_k):
    _, q, scale = _quantized_weight(70, 300)  # N, K not multiples of the blocks
    xq, x_scale = quantize_rows_reference(torch.randn(m, 300) * torch.rand(m, 1) * 10)
    config = choose_w8a8_config(m, 70, 300, sms=4, block_n=32, block_k=32, split_k=split_k)
    y = fp8_w8a8_linear(xq, x_scale, q, scale, torch.float32, config)
    assert y.shape == (m, 70) and not torch.isnan(y).any()
    assert _rel(y, _w8a8_twin(xq, x_scale, q, scale)) < 1e-6
    again = fp8_w8a8_linear(xq, x_scale, q, scale, torch.float32, config)  # counters were reset
    assert torch.equal(again, y)


def test_w8a8_chooser_fills_the_gpu_on_narrow_outputs():
    for m, n, k in [(1, 4096, 4096), (64, 6144, 4096), (64, 4096, 14336), (64, 28672, 4096)]:
        config = choose_w8a8_config(m, n, k, sms=132)
        programs = -(-n // config.block_n) * config.split_k
        assert config.block_m == max(16, min(64, 1 << (m - 1).bit_length()))
        assert programs >= 132 or config.split_k * config.block_k * 4 * 2 > k, (m, n, k, config)
        assert k // (config.block_k * config.split_k) >= 4  # each split keeps several K blocks


@interpreter
def test_w8a8_runs_through_base_gemm_as_the_oracle_says():
    w, q, scale = _quantized_weight(64, 128)
    x = torch.randn(5, 128)
    want = fp8_linear_oracle(x, q, scale, "w8a8_triton")
    xq, x_scale = quantize_rows_reference(x)
    config = choose_w8a8_config(5, 64, 128, sms=4, block_n=32, block_k=32, split_k=2)
    assert _rel(fp8_w8a8_linear(xq, x_scale, q, scale, torch.float32, config), want) < 1e-6
    assert _rel(want, fp8_linear_oracle(x, q, scale, "weight_only")) > 1e-3  # activations really rounded
