"""A Llama stack's decode projections with the ops between them, with programmatic
dependent launch (PDL) off and on: the table of ``fused_update.py --quick``.

Each layer: add + RMS norm -> q|k|v; o (attention skipped: o's input is a fixed buffer);
add + RMS norm -> gate|up -> SiLU-mul -> down, whose output is the next layer's residual
add. Variants: base+ops (the base GEMMs), kernels+ops (the segmented shrink on a side
stream beside the GEMM, then the expand: lora_decode="kernels"), own+ops (base+ops with
our decode GEMM, kernels/decode_gemm.py, in place of cuBLAS's), stacked+ops (one GEMM
over [W; A rows], then the expand choose_expand picks: lora_decode="stacked"), fused+ops
(the GEMM, shrink and expand in one launch, kernels/stacked_fused.py). Each
runs with PDL off, "early" (a kernel lets the next launch right after its wait) and
"exit" (as its programs exit); cuBLAS GEMMs launch as always.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapterserve.kernels import reference
from adapterserve.kernels.fused import add_rms_norm, silu_mul
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.pdl import set_pdl
from adapterserve.kernels.stacked import expand_for_slots, row_bucket
from benchmarks.fused_update import Projection, project
from benchmarks.measure import capture

RANK = 16
EPS = 1e-5
VARIANTS = ("base+ops", "own+ops", "kernels+ops", "stacked+ops", "fused+ops")
STACK_VARIANTS = {"base+ops": "base", "own+ops": "own", "kernels+ops": "kernels+side",
                  "stacked+ops": "stacked auto", "fused+ops": "fused"}  # fused_update's
NO_LORA = ("base+ops", "own+ops")  # the variants without adapters
PDL_MODES = ("off", "early", "exit")


@dataclass(frozen=True)
class Step:
    """One scenario's metadata, the stacked GEMM's rows, its distinct adapters."""

    meta: object
    rows: int
    adapters: int


class OpsStack:
    def __init__(self, shape, layers: int, tokens: int, slots: int, device: str, dtype) -> None:
        lin, h, inter = shape.linear_shapes(), shape.hidden, shape.inter
        q = lin["o_proj"][0]
        kinds = {"qkv": (h, (q, lin["k_proj"][1], lin["v_proj"][1])), "o": (q, (h,)),
                 "gate_up": (h, (inter, inter)), "down": (inter, (h,))}
        self.ranks, self.slots, self.device = (RANK,) * slots, slots, device
        self.layers = [{kind: Projection(k, widths, self.ranks, device, dtype) for kind, (k, widths) in kinds.items()}
                       for _ in range(layers)]
        self.norms = [[(1 + 0.1 * torch.randn(h, device=device)).to(dtype) for _ in range(2)] for _ in range(layers)]
        self.residual0 = torch.randn(tokens, h, device=device, dtype=dtype)
        self.residual = self.residual0.clone()
        self.pending0 = torch.randn(tokens, h, device=device, dtype=dtype)
        self.o_in = torch.randn(tokens, q, device=device, dtype=dtype)
        self.workspace = torch.empty(3, tokens, RANK, device=device, dtype=dtype)
        self.side = torch.cuda.Stream() if device == "cuda" else None
        self.last_qkv = torch.empty(0)

    def run(self, variant: str, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole stack as `variant` says: the last layer's (down, q|k|v) outputs."""
        self.residual.copy_(self.residual0)
        out = self.pending0
        for i in range(len(self.layers)):
            out = self._layer(i, out, variant, step)
        return out, self.last_qkv

    def _layer(self, i: int, pending: torch.Tensor, variant: str, step: Step) -> torch.Tensor:
        p, (w1, w2) = self.layers[i], self.norms[i]
        self.last_qkv = self._project(variant, p["qkv"], add_rms_norm(pending, self.residual, w1, EPS), step)
        o = self._project(variant, p["o"], self.o_in, step)
        gate_up = self._project(variant, p["gate_up"], add_rms_norm(o, self.residual, w2, EPS), step)
        return self._project(variant, p["down"], silu_mul(gate_up), step)

    def _project(self, variant: str, p: Projection, x: torch.Tensor, step: Step) -> torch.Tensor:
        return project(p, STACK_VARIANTS[variant], x, step.meta, step.rows, self.workspace[: p.n_slices], self.side)

    def reference(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 torch, the reference shrink and expand: the last layer's (down, q|k|v)."""
        residual, out, qkv = self.residual0.float(), self.pending0.float(), None
        for p, (w1, w2) in zip(self.layers, self.norms):
            residual = residual + out
            qkv = _lora_linear(_rms(residual, w1), p["qkv"], step.meta)
            residual = residual + _lora_linear(self.o_in.float(), p["o"], step.meta)
            gate, up = _lora_linear(_rms(residual, w2), p["gate_up"], step.meta).chunk(2, dim=-1)
            out = _lora_linear(F.silu(gate) * up, p["down"], step.meta)
        return out, qkv

    def floor_ms(self, adapters: int, bw: float) -> float:
        return sum(p.floor_bytes(self.ranks, adapters) for layer in self.layers for p in layer.values()) / bw * 1e3


def _rms(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()


def _lora_linear(x: torch.Tensor, p, meta) -> torch.Tensor:
    lora = p.lora_kernels
    lora32 = LoraSlices(lora.a.float(), lora.b.float(), lora.row_start, lora.rank, lora.out_offsets, lora.max_rank)
    y = F.linear(x, p.stacked.weight().float())
    work = torch.zeros(lora.num_slices, x.shape[0], lora.max_rank, device=x.device)
    reference.lora_shrink(x, lora32, meta, work)
    reference.lora_expand(work, lora32, meta, y)
    return y


def make_step(tokens: int, adapters: int, stack: OpsStack) -> Step:
    """Tokens round-robin over slots 0..adapters-1 (none: every token without adapter)."""
    slots = (torch.arange(tokens) % adapters if adapters else torch.full((tokens,), -1)).to(torch.int32)
    meta = build_adapter_meta(slots.to(stack.device), stack.slots, stacked_expand=expand_for_slots(slots.numpy()))
    rows = row_bucket(RANK * adapters, stack.layers[0]["qkv"].stacked.pool_rows)
    return Step(meta, rows, adapters)


def graph_outputs(run: Callable[[], tuple[torch.Tensor, ...]], device: str) -> tuple[torch.Tensor, ...]:
    """Copies of `run`'s outputs from one replay of its CUDA graph (eager off CUDA)."""
    if device != "cuda":
        return tuple(t.clone() for t in run())
    graph, outs = capture(run)
    graph.replay()
    torch.cuda.synchronize()
    return tuple(t.clone() for t in outs)


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def measure(stack: OpsStack, adapters: int, tokens: int, device: str, bw: float,
            time_ms: Callable[[Callable[[], object], str], float]) -> list[str]:
    """One row: ms per variant and PDL mode (tax over base+ops with PDL off), the floor,
    and the check: per variant, '=' where every PDL mode's outputs equal PDL off's
    (torch.equal, one graph replay each), then PDL off's max |out - ref| / max |ref|
    (base+ops against the reference without adapters)."""
    step = make_step(tokens, adapters, stack)
    ms, outs = {}, {}
    try:
        for mode in PDL_MODES:
            set_pdl(mode)
            for v in VARIANTS:
                ms[v, mode] = time_ms(lambda v=v: stack.run(v, step), device)
                outs[v, mode] = graph_outputs(lambda v=v: stack.run(v, step), device)
    finally:
        set_pdl("off")
    with_lora, without = stack.reference(step), stack.reference(make_step(tokens, 0, stack))
    want = {v: without if v in NO_LORA else with_lora for v in VARIANTS}
    base = ms["base+ops", "off"]
    cells = []
    for v in VARIANTS:
        for mode in PDL_MODES:
            tax = "" if (v, mode) == ("base+ops", "off") else f" ({(ms[v, mode] / base - 1) * 100:+.1f}%)"
            cells.append(f"{ms[v, mode]:.3f}{tax}")
    checks = []
    for v in VARIANTS:
        same = all(all(torch.equal(a, b) for a, b in zip(outs[v, m], outs[v, "off"])) for m in PDL_MODES)
        err = max(max_rel(out, ref) for out, ref in zip(outs[v, "off"], want[v]))
        checks.append(f"{'=' if same else 'DIFF'} {err:.0e}")
    name = f"{adapters} x r{RANK}" if adapters else "no adapter"
    return [name, *cells, f"{stack.floor_ms(adapters, bw):.3f}", ", ".join(checks)]


def header() -> list[str]:
    cols = [f"{v} {'' if m == 'off' else 'pdl ' + m}".strip() for v in VARIANTS for m in PDL_MODES]
    return ["adapters", *[f"{c} ms" for c in cols], "floor ms", "check (= pdl identical, rel err vs f32)"]
