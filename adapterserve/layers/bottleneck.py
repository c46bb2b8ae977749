"""Bottleneck adapters on the residual stream: the pool of one place and its op.

A pool holds every slot's weights for one place of one layer, preallocated;
loading copies into a slot, so tensor addresses never change. Layers read the
step's ``BatchContext.bottleneck`` metadata and call the kernels' bottleneck op.
(LoRA and (IA)^3 live in ``AdapterLinear``.)

Bottleneck placement follows the ``adapters`` library 1.3 for Houlsby
(``DoubleSeqBnConfig``) and Pfeiffer (``SeqBnConfig``) adapters; see
``adapterserve.adapters_store.formats.adapterhub`` for the exact order. Per row:

    x = sublayer output (attention output dense / FFN output dense), r = sublayer input
    h = norm(x + r) if the slot's adapter has original_ln_before (Pfeiffer) else x
    a = x + up(act(down(h)))             # residual_before_ln: the adapter's residual is x
    out = norm(a + r)                    # original_ln_after; rows without adapter: norm(x + r)

``norm`` is the sublayer's own LayerNorm (post-LN BERT); pass None for pre-LN
decoders (Llama), where adapters 1.3 computes the same with the norm left out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from adapterserve.adapters_store.formats.types import (
    BOTTLENECK_POSITIONS,
    BottleneckAdapter,
    BottleneckModule,
)
from adapterserve.kernels import (
    AdapterBatchMeta,
    bottleneck_adapter,
    build_adapter_meta,
)
from adapterserve.kernels.segment_common import ACT_CODES
from adapterserve.kernels.segment_ops import use_gemv
from adapterserve.layers.context import get_context

# Canonical activation names of the bottleneck op (one op call serves them all: a code per slot).
BOTTLENECK_ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "tanh")


@dataclass
class BottleneckPool:
    """Every slot's bottleneck adapter at one place (after attention or FFN) of one layer.

    down:      [S, R, D] rows of W_down;        down_bias: [S, R]
    up:        [S, R, D] rows of W_up^T, scaling folded in;  up_bias: [S, D]
    rank:      [S] int32, the width of each slot's adapter here (0: none at this place)
    activation: [S] int32, each slot's activation (kernels' ACT_CODES; read where rank > 0)
    ln_mix:    [S] 1.0 where the slot's adapter reads norm(x + r) (original_ln_before: Pfeiffer), else 0.0,
               in the pool's dtype (pre-LN decoders: h = x + ln_mix * r); a model's pools share one
               (add_bottleneck_pools: a property of the adapter, read only where rank > 0)
    workspace: [Tmax, R] scratch for the op; one tensor may serve every pool
    """

    down: torch.Tensor
    down_bias: torch.Tensor
    up: torch.Tensor
    up_bias: torch.Tensor
    rank: torch.Tensor
    activation: torch.Tensor
    ln_mix: torch.Tensor
    workspace: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, max_rank: int, dim: int, workspace: torch.Tensor,
              ln_mix: torch.Tensor | None = None) -> "BottleneckPool":
        """Zeroed pool on the workspace's device and dtype (ln_mix: one shared with other pools)."""
        opts = dict(dtype=workspace.dtype, device=workspace.device)
        codes = dict(dtype=torch.int32, device=workspace.device)
        return cls(
            down=torch.zeros(num_slots, max_rank, dim, **opts),
            down_bias=torch.zeros(num_slots, max_rank, **opts),
            up=torch.zeros(num_slots, max_rank, dim, **opts),
            up_bias=torch.zeros(num_slots, dim, **opts),
            rank=torch.zeros(num_slots, **codes),
            activation=torch.zeros(num_slots, **codes),
            ln_mix=torch.zeros(num_slots, **opts) if ln_mix is None else ln_mix,
            workspace=workspace,
        )

    def load(self, slot: int, module: BottleneckModule | None, ln_before: bool) -> None:
        """Copy one adapter's weights for this place into ``slot`` (None: no adapter here; its
        ln_mix is still the adapter's, as in the other places that share it)."""
        self.clear(slot)
        self.ln_mix[slot] = float(ln_before)
        if module is None:
            return
        r = module.rank
        if r > self.down.shape[1] or module.activation not in BOTTLENECK_ACTIVATIONS:
            raise ValueError(
                f"bottleneck of width {r} with {module.activation} does not fit a pool of width "
                f"{self.down.shape[1]} and activations {list(BOTTLENECK_ACTIVATIONS)}"
            )
        self.down[slot, :r].copy_(module.down)
        self.down_bias[slot, :r].copy_(module.down_bias)
        self.up[slot, :r].copy_(module.up)
        self.up_bias[slot].copy_(module.up_bias)
        self.activation[slot] = ACT_CODES[module.activation]
        self.rank[slot] = r

    def clear(self, slot: int) -> None:
        self.rank[slot] = 0
        self.activation[slot] = 0
        self.down[slot].zero_()
        self.down_bias[slot].zero_()
        self.up[slot].zero_()
        self.up_bias[slot].zero_()
        self.ln_mix[slot] = 0.0


def add_bottleneck_pools(
    layers: Sequence[torch.nn.Module], dim: int, num_slots: int, max_rank: int, max_tokens: int,
    dtype: torch.dtype, device: torch.device | str,
) -> None:
    """Give every layer an empty pool per place (``bottleneck_mh``, ``bottleneck_output``), one shared
    workspace and one shared ln_mix (a step gathers its rows' mixes once: ``add_bottlenecks``)."""
    workspace = torch.zeros(max_tokens, max_rank, dtype=dtype, device=device)
    ln_mix = torch.zeros(num_slots, dtype=dtype, device=device)
    for layer in layers:
        for place in BOTTLENECK_POSITIONS:
            setattr(layer, f"bottleneck_{place}", BottleneckPool.empty(num_slots, max_rank, dim, workspace, ln_mix))


def load_bottleneck(layers: Sequence[torch.nn.Module], slot: int, adapter: BottleneckAdapter | None) -> None:
    """Copy an adapter into ``slot`` of every layer's pools (None empties the slot)."""
    for index, layer in enumerate(layers):
        for place in BOTTLENECK_POSITIONS:
            module = adapter.modules.get((index, place)) if adapter is not None else None
            ln_before = adapter.original_ln_before if adapter is not None else False
            getattr(layer, f"bottleneck_{place}").load(slot, module, ln_before)


def bottlenecks_active(pool: BottleneckPool | None) -> bool:
    """Whether this step runs ``pool``'s op: it has rows with bottleneck adapters. No host
    state of the pool counts, so a captured graph holds the op whichever adapters were
    resident then (a slot without an adapter at this place has width 0: the op skips it)."""
    return pool is not None and get_context().bottleneck is not None


def residual_sublayer(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor] | None,
    pool: BottleneckPool | None,
) -> torch.Tensor:
    """The residual add (and post-norm) closing a sublayer, with each row's bottleneck.

    x, residual: [T, D]. Rows without adapter get norm(x + residual), as the backbone.
    """
    meta = get_context().bottleneck
    summed = x + residual
    if not bottlenecks_active(pool):
        return norm(summed) if norm is not None else summed
    normed = norm(summed) if norm is not None else summed
    slots = meta.token_slots.long().clamp(min=0)
    h = torch.where(pool.ln_mix[slots].unsqueeze(-1) != 0, normed, x)
    a = x.clone()
    workspace = pool.workspace[: x.shape[0]]
    bottleneck_adapter(h, pool.down, pool.down_bias, pool.up, pool.up_bias, pool.rank, pool.activation, meta,
                       workspace, a)
    out = a + residual
    return norm(out) if norm is not None else out


def add_bottlenecks(x: torch.Tensor, residual: torch.Tensor, pool: BottleneckPool) -> None:
    """For pre-LN decoders (residual_sublayer without a norm): x += each row's bottleneck update,
    in place, read from h = x + r (original_ln_before) or x. The caller then adds x into the
    residual as it does without adapters (fused with the next norm), which gives
    residual_sublayer's sum, (x + update) + r. Decode-sized steps: two launches, the shrink
    forming h as it reads x and r; wider ones form h first (the step's mixes gathered once)."""
    meta = get_context().bottleneck
    workspace = pool.workspace[: x.shape[0]]
    if use_gemv(x.shape[0], pool.down.shape[1]):  # the CUDA-core shrink forms h as it reads: no launch for it
        bottleneck_adapter(x, pool.down, pool.down_bias, pool.up, pool.up_bias, pool.rank, pool.activation, meta,
                           workspace, x, residual, pool.ln_mix)
        return
    h = torch.addcmul(x, _rows_mix(pool), residual)
    bottleneck_adapter(h, pool.down, pool.down_bias, pool.up, pool.up_bias, pool.rank, pool.activation, meta,
                       workspace, x)


def _rows_mix(pool: BottleneckPool) -> torch.Tensor:
    """[T, 1] each row's ln_mix (slot -1: any row's mix, unused), gathered once a step for the pools
    that share one ln_mix (add_bottleneck_pools), not once a place: two launches a place fewer."""
    ctx = get_context()
    key = pool.ln_mix.data_ptr()
    if ctx.bottleneck_mix is None or ctx.bottleneck_mix[0] != key:
        ctx.bottleneck_mix = (key, pool.ln_mix[ctx.bottleneck.token_slots].unsqueeze(-1))
    return ctx.bottleneck_mix[1]


def encoder_adapter_meta(row_slots: torch.Tensor, attention_mask: torch.Tensor, num_slots: int) -> AdapterBatchMeta:
    """Adapter metadata for a padded [B, L] batch flattened to T = B * L tokens.

    row_slots: [B] int, each row's slot (-1 = base model). A token's slot is its
    row's; padding tokens get -1, so no adapter spends work on them.
    """
    if row_slots.shape[0] != attention_mask.shape[0]:
        raise ValueError(f"row_slots has {row_slots.shape[0]} rows but attention_mask has {attention_mask.shape[0]}")
    slots = torch.where(attention_mask.bool(), row_slots.view(-1, 1).to(torch.int32), -1)
    return build_adapter_meta(slots.flatten(), num_slots)
