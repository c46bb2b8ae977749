"""The frozen base product of an AdapterLinear: y = x W^T (+ bias).

Weights are either in the activations' dtype (plain F.linear) or float8_e4m3fn with
one float32 scale per output channel (an FP8 backbone). FP8 kernels, chosen by
``fp8_gemm``:
  scaled_mm    activations quantized per token to e4m3, torch._scaled_mm with row-wise
               scales (Hopper and later)
  w8a8_triton  the same arithmetic as scaled_mm in a Triton GEMM tuned for decode batches
               (split-K for narrow outputs; kernels/fp8_w8a8.py)
  weight_only  bf16 activations, weights widened in a Triton GEMM's mainloop
  decode_w8a8  per-token e4m3 activations in our decode GEMM (kernels/decode_gemm.py: split-K,
               PDL) for decode batches of at most 64 tokens; scaled_mm above
  decode_weight_only  bf16 activations, e4m3 weights widened in our decode GEMM for decode
               batches (no activation quantization); scaled_mm above 64 tokens
  reference    dequantize to the activations' dtype, F.linear (CPU; the oracle)
  auto         on sm_90+ decode_w8a8 for decode batches (at most 64 tokens; w8a8_triton for
               weights too large for its 32-bit offsets), else scaled_mm; weight_only on other
               CUDA devices; reference on CPU
On CPU, scaled_mm and w8a8_triton are emulated in float32 (their e4m3 activations times the
dequantized weight); the others run the reference.

Weights in the activations' dtype run F.linear (cuBLAS), or for decode batches our split-K
GEMM (kernels/decode_gemm.py) as ``decode_gemm`` says (EngineConfig.decode_gemm).

The kernels that quantize activations take them either as x (quantized here, one launch)
or already quantized by the op that made x (``quantized``: kernels/fp8_fused.py), which
must be exactly quantize_rows(x).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from adapterserve.config import DECODE_GEMMS, FP8_GEMMS
from adapterserve.kernels.split_counters import INDEX_LIMIT

ACTIVATION_QUANTIZING = ("scaled_mm", "w8a8_triton", "decode_w8a8")  # kernels that round activations to e4m3
DECODE_FP8 = ("decode_w8a8", "decode_weight_only")  # our decode GEMM up to DECODE_GEMM_MAX_ROWS tokens
DECODE_GEMM_MAX_ROWS = 64  # kernels/decode_gemm.MAX_ROWS
AUTO_WIDE, AUTO_DEEP = 16384, 8192  # decode_gemm "auto": ours for outputs or inputs at least this wide
QuantizedRows = tuple[torch.Tensor, torch.Tensor]  # (q [T, K] float8_e4m3fn, scale [T, 1] float32)


def base_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                bias: torch.Tensor | None, fp8_gemm: str = "auto", quantized: QuantizedRows | None = None,
                decode_gemm: str = "cublas") -> torch.Tensor:
    """x: [T, K] -> [T, N] in x's dtype. weight_scale: None (weight in x's dtype) or [N].
    quantized: x's per-token e4m3 rounding, if already made (used by the kernels that need it).
    decode_gemm: which kernel runs a decode batch's product with weights in x's dtype."""
    if weight_scale is None:
        if not uses_decode_gemm(decode_gemm, x, weight):
            return F.linear(x, weight, bias)
        from adapterserve.kernels.decode_gemm import decode_config, decode_gemm as triton_decode_gemm

        y = triton_decode_gemm(x, weight, decode_config(*weight.shape))
        return y if bias is None else y.add_(bias)
    y = fp8_linear(x, weight, weight_scale, fp8_gemm, quantized)
    return y if bias is None else y.add_(bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, fp8_gemm: str = "auto",
               quantized: QuantizedRows | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K] float8_e4m3fn, weight_scale: [N] float32 -> [T, N] in x's dtype."""
    kernel = fp8_kernel_for(fp8_gemm, x.device, x.shape[0], weight)
    if kernel == "reference":
        return fp8_linear_reference(x, weight, weight_scale)
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    if not x.is_cuda:  # an activation-quantizing kernel asked for on CPU
        return fp8_a8_emulated(*quantized_rows(x, quantized), weight, weight_scale, x.dtype)
    if kernel == "scaled_mm":
        return fp8_scaled_mm(x, weight, weight_scale, quantized)
    if kernel == "w8a8_triton":
        return fp8_w8a8(x, weight, weight_scale, quantized)
    if kernel == "decode_w8a8":
        return fp8_decode_w8a8(x, weight, weight_scale, quantized)
    if kernel == "decode_weight_only":
        from adapterserve.kernels.decode_gemm import fp8_decode_gemm

        return fp8_decode_gemm(x.contiguous(), weight, weight_scale)
    from adapterserve.kernels.fp8_gemm import fp8_weight_only_linear

    return fp8_weight_only_linear(x.contiguous(), weight, weight_scale)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Dequantize (weight * scale, rounded once to x's dtype) and run F.linear."""
    return F.linear(x, _dequantized(weight, weight_scale).to(x.dtype))


def fp8_linear_oracle(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, kernel: str
                      ) -> torch.Tensor:
    """What ``kernel`` computes, in float32 on x's device: the dequantized weight times x,
    with x first rounded per token to e4m3 for the kernels that quantize activations."""
    if kernel in ACTIVATION_QUANTIZING:
        from adapterserve.kernels.fp8 import quantize_rows_reference

        return fp8_a8_emulated(*quantize_rows_reference(x), weight, weight_scale, torch.float32)
    return F.linear(x.float(), _dequantized(weight, weight_scale))


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  quantized: QuantizedRows | None = None) -> torch.Tensor:
    """Per-token e4m3 activations (one Triton launch unless given) times the e4m3 weight,
    row-wise scales."""
    q, x_scale = quantized_rows(x, quantized)
    return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                            out_dtype=x.dtype)


def fp8_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             quantized: QuantizedRows | None = None) -> torch.Tensor:
    """Per-token e4m3 activations (quantized here unless given) times the e4m3 weight in the
    Triton W8A8 GEMM."""
    from adapterserve.kernels.fp8_w8a8 import fp8_w8a8_linear

    q, x_scale = quantized_rows(x, quantized)
    return fp8_w8a8_linear(q, x_scale, weight, weight_scale, x.dtype)


def fp8_decode_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    quantized: QuantizedRows | None = None) -> torch.Tensor:
    """Per-token e4m3 activations (quantized here unless given) times the e4m3 weight in our
    decode GEMM (a decode batch)."""
    from adapterserve.kernels.decode_gemm import fp8_decode_gemm

    q, x_scale = quantized_rows(x, quantized)
    return fp8_decode_gemm(q, weight, weight_scale, x_scale, x.dtype)


def quantized_rows(x: torch.Tensor, quantized: QuantizedRows | None) -> QuantizedRows:
    """x's per-token e4m3 rounding: ``quantized`` when the op before made it, else one launch now."""
    if quantized is not None:
        return quantized
    from adapterserve.kernels.fp8 import quantize_rows

    return quantize_rows(x)


def _dequantized(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """[N, K] float32: the e4m3 weight times its per-channel scales."""
    return weight.float() * weight_scale.float()[:, None]


def fp8_a8_emulated(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """What scaled_mm / w8a8_triton compute, in float32 torch (CPU): the e4m3 activations
    times the dequantized weight, rounded once to out_dtype."""
    return F.linear(q.float() * x_scale, _dequantized(weight, weight_scale)).to(out_dtype)


def uses_decode_gemm(decode_gemm: str, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether our decode GEMM (kernels/decode_gemm.py) runs x @ weight.T: "triton" for every
    CUDA batch of 1 to 64 contiguous rows; "auto" for those on sm_90+ where the output is wide
    or the input deep (where it measured faster than cuBLAS); never "cublas"."""
    if decode_gemm not in DECODE_GEMMS:
        raise ValueError(f"decode_gemm must be one of {', '.join(DECODE_GEMMS)}, got {decode_gemm!r}")
    if decode_gemm == "cublas" or not x.is_cuda or not 0 < x.shape[0] <= DECODE_GEMM_MAX_ROWS:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.dtype != x.dtype:
        return False
    if weight.shape[0] * weight.stride(0) >= INDEX_LIMIT:  # it indexes in 32 bits: cuBLAS takes these
        return False
    if decode_gemm == "triton":
        return True
    n, k = weight.shape
    return _capability(x.device.index) >= (9, 0) and (n >= AUTO_WIDE or k >= AUTO_DEEP)


def resolve_fp8_gemm(fp8_gemm: str, device: torch.device, tokens: int = 1) -> str:
    """The kernel that runs for ``fp8_gemm`` on ``device`` for ``tokens`` rows ('auto' resolved)."""
    if fp8_gemm not in FP8_GEMMS:
        raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)}, got {fp8_gemm!r}")
    if device.type != "cuda":
        return fp8_gemm if fp8_gemm in ACTIVATION_QUANTIZING else "reference"
    if fp8_gemm == "auto":
        if _capability(device.index) < (9, 0):
            return "weight_only"
        fp8_gemm = "decode_w8a8"
    if fp8_gemm in DECODE_FP8:
        return fp8_gemm if tokens <= DECODE_GEMM_MAX_ROWS else "scaled_mm"
    return fp8_gemm


def fp8_kernel_for(fp8_gemm: str, device: torch.device, tokens: int, weight: torch.Tensor) -> str:
    """resolve_fp8_gemm, then w8a8_triton (the same arithmetic, 64-bit offsets) for decode_w8a8
    on a weight whose offsets the decode GEMM's 32 bits cannot hold."""
    kernel = resolve_fp8_gemm(fp8_gemm, device, tokens)
    if kernel == "decode_w8a8" and device.type == "cuda" and weight.shape[0] * weight.stride(0) >= INDEX_LIMIT:
        return "w8a8_triton"
    return kernel


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
