"""Next-token sampling for a batch where every row has its own parameters.

Logit bias and penalties come first (engine/penalties.py), for greedy rows too.
Temperature, top-k and top-p are applied to the whole batch at once. The random
draw uses the exponential-race form of sampling (argmax of p / E, E ~ Exp(1)),
so a seeded request draws its noise from its own generator and gets the same
tokens whatever else is in the batch. Nothing here waits for the GPU: the chosen
ids stay on the device, and the per-row parameters go up through pinned memory.
"""
from __future__ import annotations

import torch

from adapterserve.engine.host_copy import to_device
from adapterserve.engine.penalties import StepPenalties, apply_penalties
from adapterserve.engine.sampling_params import SamplingParams


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # top_k: [B] long, 0 = off
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # keep the smallest set of tokens whose probability reaches top_p
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
    penalties: StepPenalties | None = None,
) -> torch.Tensor:
    """logits: [B, V] float32 -> one token id per row: [B] long, on the logits' device.
    The logits are not changed in place."""
    device = logits.device
    if penalties is not None:
        logits = apply_penalties(logits, penalties)
    chosen = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return chosen
    greedy = to_device([p.greedy for p in params], device, torch.bool)
    temps = to_device([p.temperature if not p.greedy else 1.0 for p in params], device, torch.float32)
    scaled = logits / temps.unsqueeze(1)
    if any(p.top_k for p in params):
        scaled = _apply_top_k(scaled, to_device([p.top_k for p in params], device, torch.long))
    if any(p.top_p < 1.0 for p in params):
        scaled = _apply_top_p(scaled, to_device([p.top_p for p in params], device, torch.float32))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=default_generator)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, chosen, drawn)
