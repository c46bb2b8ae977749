"""Adapter-aware layers: the frozen base output for the whole batch, plus each
row's own adapter update through the kernels in adapterserve.kernels.

Tensor parallelism (``parallel``, Megatron style, over ``tp``'s ranks):
  column  each rank holds its rows of every fused slice (its heads, its intermediate
          columns); the input is replicated, the output is this rank's part. LoRA: A
          whole, B's output rows split. (IA)^3: output scales split.
  row     each rank holds its input columns; the output is summed over the ranks by one
          all-reduce, then the bias is added (once) and (IA)^3 output scales applied.
          LoRA: A's input columns split, B whole, and no all-reduce of the shrink: the
          update is linear in it, sum_r (x_r A_r^T) B^T = (x A^T) B^T, so each rank adds
          its partial update to its partial base output and the layer's one all-reduce
          sums both. (IA)^3: input scales split.
Which part of an adapter's tensors a rank keeps comes from the layer's ``layout``
(layers/linear_spans.py): its ``spans`` for this rank, and rank 0's ``layout.spans`` of
any other rank when it cuts an adapter for that rank (engine/adapter_shard.py).
"""
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
from adapterserve.layers.fused_lora import fused_lora_linear
from adapterserve.layers.ia3_places import Ia3Places
from adapterserve.layers.linear_spans import LinearLayout
from adapterserve.layers.parallel import SINGLE, TensorParallel

PARALLEL_MODES = (None, "column", "row")


class AdapterLinear(torch.nn.Module):
    """A frozen linear layer, possibly several projections fused (q|k|v, gate|up).

    Each fused projection is a slice of the output named by its module kind, so
    LoRA adapters written for the unfused model land on the right columns.
    ``lora`` holds the pooled weights of every slot; the slot manager fills it.
    With ``fp8``, ``weight`` is float8_e4m3fn with a float32 ``weight_scale`` per output
    channel (bias, adapters and activations stay in ``dtype``).
    Sizes are the unsharded ones; with ``parallel`` over several ranks, ``in_features`` and
    ``slice_widths`` become this rank's (see the module docstring). A column-parallel layer
    splits each slice evenly, or by whole heads where ``slice_heads`` gives its head count
    (LinearLayout: KV heads, replicated when there are fewer than ranks).
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
        parallel: str | None = None,
        tp: TensorParallel = SINGLE,
        slice_heads: tuple[int | None, ...] | None = None,
    ) -> None:
        super().__init__()
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        self.parallel = parallel if tp.world_size > 1 else None
        self.tp = tp
        self.full_in_features, self.full_slice_widths = in_features, slice_widths
        self.layout = LinearLayout(parallel, in_features, slice_widths, slice_kinds, slice_heads)
        self.spans = self.layout.spans(tp.rank, tp.world_size)  # this rank's part of the full tensors
        in_features = self.spans.input[1]
        slice_widths = tuple(length for _, length in self.spans.outputs)
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
        self.decode_gemm = "cublas"  # which kernel runs a decode batch's bf16/fp16 base product (base_gemm)
        self.fuse_input_quant = True  # FP8: may take its input quantized by the op that made it
        self.bias = (
            torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.lora: LoraSlices | None = None
        self.ia3_in: torch.Tensor | None = None  # [S, K] (IA)^3 input scales (none on fused projections)
        self.ia3_out: torch.Tensor | None = None  # [S, N] (IA)^3 output scales
        self.ia3_places: Ia3Places | None = None  # which scales a step launches (the pool's tier; None: all)
        self.side_stream: torch.cuda.Stream | None = None  # runs the LoRA shrink beside the base GEMM
        self.stacked: StackedWeight | None = None  # [W; A] buffer when the pool stacks A under the weight

    def forward(self, x: torch.Tensor, quantized: QuantizedRows | None = None, scratch_input: bool = False
                ) -> torch.Tensor:
        """x: [T, K] -> y: [T, N]. quantized: x rounded to e4m3 per token (quantize_rows(x)),
        given only where ``takes_quantized_input`` said so; adapters read x. scratch_input: the
        caller reads x no more, so (IA)^3 input scales may be applied to it in place."""
        ctx = get_context()
        ia3 = ctx.ia3 if self.ia3_out is not None else None
        if ia3 is not None and self.ia3_in is not None and self._ia3_scales("in"):  # none on fused projections
            x = x if scratch_input else x.clone()
            ia3_scale(x, self.ia3_in, ia3)
            quantized = None  # it rounds the unscaled x
        if self.lora is not None and ctx.lora is not None:
            y = self._with_lora(x, ctx, quantized)
        else:
            y = self.base_product(x, quantized)
        if self.parallel == "row":  # partial sums (base and LoRA) -> the full output, then the bias once
            self.tp.all_reduce_(y)
            if self.bias is not None:
                y.add_(self.bias)
        if ia3 is not None and self._ia3_scales("out"):
            ia3_scale(y, self.ia3_out, ia3)
        return y

    def _ia3_scales(self, side: str) -> bool:
        """Whether this step's (IA)^3 tier launches this linear's ``side`` scale."""
        return self.ia3_places is None or self.ia3_places.scales(self.slice_kinds, side)

    def takes_quantized_input(self, tokens: int) -> bool:
        """Whether this batch's input should come quantized with it (one fused launch in the
        op before): FP8 weights, a kernel that rounds activations to e4m3, and no (IA)^3
        rows scaling the input first."""
        if self.weight_scale is None or not self.fuse_input_quant:
            return False
        if self.ia3_in is not None and get_context().ia3 is not None and self._ia3_scales("in"):
            return False
        return resolve_fp8_gemm(self.fp8_gemm, self.weight.device, tokens) in ACTIVATION_QUANTIZING

    def base_product(self, x: torch.Tensor, quantized: QuantizedRows | None = None) -> torch.Tensor:
        """The frozen base output x W^T + b, whatever the weights' storage (row-parallel over
        several ranks: this rank's partial product, without the bias)."""
        return base_linear(x, self.weight, self.weight_scale, self._local_bias(), self.fp8_gemm, quantized,
                           self.decode_gemm)

    def _local_bias(self) -> torch.Tensor | None:
        """The bias this rank adds before any all-reduce: none on a row-parallel layer."""
        return None if self.parallel == "row" else self.bias

    def _with_lora(self, x: torch.Tensor, ctx, quantized: QuantizedRows | None = None) -> torch.Tensor:
        """Base output plus each row's LoRA update. With a side stream (decode steps), the shrink
        (small, latency-bound) runs concurrently with the base GEMM; the expand adds into its output."""
        if self.stacked is not None and x.shape[0] <= STACKED_MAX_TOKENS:
            if self.stacked.joint:
                return self._stacked_lora(x, ctx)
            if ctx.lora.stacked_expand == "fused":  # A rows kept apart; steps of more adapters take the kernels
                return fused_lora_linear(x, self.weight, self.weight_scale, self.stacked, self.lora, ctx.lora,
                                         self.stacked.rows_in_use.rows, self._local_bias(), self.fp8_gemm, quantized)
        workspace = ctx.lora_workspace[: self.lora.num_slices, : x.shape[0]]
        # the side stream only in decode steps (CUDA graphs: free at replay); an eager step with
        # prefills is bound by the host's launches, which the stream switches would add to
        if self.side_stream is None or ctx.attention is None or not ctx.attention.decode:
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
        one launch (the expand the step chose) writes base + bias + each token's own expand."""
        out = stacked_gemm(x, self.stacked, self.stacked.rows_in_use.rows)
        y = torch.empty(x.shape[0], self.stacked.n_out, dtype=x.dtype, device=x.device)
        stacked_expand(out, self.lora, ctx.lora, y, self._local_bias(), ctx.lora.stacked_expand)
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
