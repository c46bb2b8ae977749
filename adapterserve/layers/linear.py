"""Adapter-aware layers: the frozen base output for the whole batch, plus each
row's own adapter update through the kernels in adapterserve.kernels."""
from __future__ import annotations

import torch

from adapterserve.kernels import (
    LoraSlices,
    ia3_scale,
    lora_expand,
    lora_shrink,
    stacked_expand,
)
from adapterserve.kernels.fp8_fused import rms_norm_quant
from adapterserve.kernels.fused import add_rms_norm, rms_norm
from adapterserve.kernels.stacked import STACKED_MAX_TOKENS, StackedWeight, stacked_gemm
from adapterserve.layers.base_gemm import (
    ACTIVATION_QUANTIZING,
    QuantizedRows,
    base_linear,
    resolve_fp8_gemm,
)
from adapterserve.layers.context import get_context


class AdapterLinear(torch.nn.Module):
    """A frozen linear layer, possibly several projections fused (q|k|v, gate|up).

    Each fused projection is a slice of the output named by its module kind, so
    LoRA adapters written for the unfused model land on the right columns.
    ``lora`` holds the pooled weights of every slot; the slot manager fills it.
    With ``fp8``, ``weight`` is float8_e4m3fn with a float32 ``weight_scale`` per output
    channel (bias, adapters and activations stay in ``dtype``).
    """

    def __init__(
        self,
        in_features: int,
        slice_widths: tuple[int, ...],
        slice_kinds: tuple[str, ...],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        fp8: bool = False,
    ) -> None:
        super().__init__()
        out_features = sum(slice_widths)
        self.in_features = in_features
        self.slice_widths = slice_widths
        self.slice_kinds = slice_kinds
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn if fp8 else dtype, device=device),
            requires_grad=False,
        )
        self.weight_scale = (
            torch.nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device), requires_grad=False)
            if fp8
            else None
        )
        self.fp8_gemm = "auto"  # which FP8 kernel runs the base product (layers.base_gemm)
        self.fuse_input_quant = True  # FP8: may take its input quantized by the op that made it
        self.bias = (
            torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.lora: LoraSlices | None = None
        self.ia3_in: torch.Tensor | None = None  # [S, K] (IA)^3 input scales
        self.ia3_out: torch.Tensor | None = None  # [S, N] (IA)^3 output scales
        self.side_stream: torch.cuda.Stream | None = None  # runs the LoRA shrink beside the base GEMM
        self.stacked: StackedWeight | None = None  # [W; A] buffer when the pool stacks A under the weight

    def forward(self, x: torch.Tensor, quantized: QuantizedRows | None = None) -> torch.Tensor:
        """x: [T, K] -> y: [T, N]. quantized: x rounded to e4m3 per token (quantize_rows(x)),
        given only where ``takes_quantized_input`` said so; adapters read x."""
        ctx = get_context()
        ia3 = ctx.ia3 if self.ia3_in is not None else None
        if ia3 is not None:
            x = x.clone()
            ia3_scale(x, self.ia3_in, ia3)
            quantized = None  # it rounds the unscaled x
        if self.lora is not None and ctx.lora is not None:
            y = self._with_lora(x, ctx, quantized)
        else:
            y = self.base_product(x, quantized)
        if ia3 is not None:
            ia3_scale(y, self.ia3_out, ia3)
        return y

    def takes_quantized_input(self, tokens: int) -> bool:
        """Whether this batch's input should come quantized with it (one fused launch in the
        op before): FP8 weights, a kernel that rounds activations to e4m3, and no (IA)^3
        rows scaling the input first."""
        if self.weight_scale is None or not self.fuse_input_quant:
            return False
        if self.ia3_in is not None and get_context().ia3 is not None:
            return False
        return resolve_fp8_gemm(self.fp8_gemm, self.weight.device, tokens) in ACTIVATION_QUANTIZING

    def base_product(self, x: torch.Tensor, quantized: QuantizedRows | None = None) -> torch.Tensor:
        """The frozen base output x W^T + b, whatever the weights' storage."""
        return base_linear(x, self.weight, self.weight_scale, self.bias, self.fp8_gemm, quantized)

    def _with_lora(self, x: torch.Tensor, ctx, quantized: QuantizedRows | None = None) -> torch.Tensor:
        """Base output plus each row's LoRA update. With a side stream, the shrink (small,
        latency-bound) runs concurrently with the base GEMM; the expand adds into its output."""
        if self.stacked is not None and x.shape[0] <= STACKED_MAX_TOKENS:
            return self._stacked_lora(x, ctx)
        workspace = ctx.lora_workspace[: self.lora.num_slices, : x.shape[0]]
        if self.side_stream is None:
            y = self.base_product(x, quantized)
            lora_shrink(x, self.lora, ctx.lora, workspace)
        else:
            main = torch.cuda.current_stream()
            self.side_stream.wait_stream(main)
            with torch.cuda.stream(self.side_stream):
                lora_shrink(x, self.lora, ctx.lora, workspace)
            y = self.base_product(x, quantized)
            main.wait_stream(self.side_stream)
        lora_expand(workspace, self.lora, ctx.lora, y)
        return y

    def _stacked_lora(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """One GEMM over [W; A rows in use] gives the base output and every slot's shrink;
        one launch writes base + bias + each token's own expand."""
        out = stacked_gemm(x, self.stacked, self.stacked.rows_in_use.rows)
        y = torch.empty(x.shape[0], self.stacked.n_out, dtype=x.dtype, device=x.device)
        stacked_expand(out, self.lora, ctx.lora, y, self.bias)
        return y


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place; returns the norm of the sum (one fused launch on a GPU)."""
        return add_rms_norm(x, residual, self.weight, self.eps)

    def quantized(self, x: torch.Tensor, residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, QuantizedRows]:
        """The norm of x (with residual: residual += x first, the norm of the sum) and its
        per-token e4m3 rounding, in one launch on a GPU."""
        normed, q, scale = rms_norm_quant(x, self.weight, self.eps, residual)
        return normed, (q, scale)
