"""AdapterLinear's (IA)^3 input scales with ``scratch_input``: applied in place on the caller's
input (the decoder's linears read fresh outputs no one reads after) they give the output of the
copying path bit for bit, and touch only the rows of tokens with an (IA)^3 adapter."""
from __future__ import annotations

import torch

from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.layers.context import BatchContext, set_context
from adapterserve.layers.linear import AdapterLinear


def _linear(gen: torch.Generator) -> AdapterLinear:
    linear = AdapterLinear(24, (16, 8), ("gate_proj", "up_proj"), True, torch.float32, "cpu")
    linear.weight.data.copy_(torch.randn(linear.weight.shape, generator=gen))
    linear.bias.data.copy_(torch.randn(linear.bias.shape, generator=gen))
    linear.ia3_in = 1.0 + torch.rand(3, 24, generator=gen)
    linear.ia3_out = 1.0 + torch.rand(3, 24, generator=gen)
    return linear


def test_scratch_input_scales_in_place_and_changes_no_output():
    gen = torch.Generator().manual_seed(5)
    linear = _linear(gen)
    slots = torch.tensor([0, -1, 2, 1, -1], dtype=torch.int32)
    ctx = BatchContext(attention=None, lora=None, lora_workspace=None, logits_rows=None,
                       ia3=build_adapter_meta(slots, 3))
    x = torch.randn(5, 24, generator=gen)
    set_context(ctx)
    try:
        kept, scratch = x.clone(), x.clone()
        copied_out = linear(kept)
        in_place_out = linear(scratch, scratch_input=True)
    finally:
        set_context(None)
    assert torch.equal(in_place_out, copied_out)
    assert torch.equal(kept, x)  # the copying path leaves its input as it was
    rows = slots >= 0
    assert torch.equal(scratch[~rows], x[~rows])
    assert torch.equal(scratch[rows], x[rows] * linear.ia3_in[slots[rows].long()])
