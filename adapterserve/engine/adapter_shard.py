"""An adapter cut for one tensor-parallel rank: what that rank's pools read, and no more.

Rank 0 keeps whole adapters (its own pools take its part through its layers' spans). For
each worker it cuts an ``AdapterShard`` (``AdapterCutter``), with the same span arithmetic
the worker's layers use (LinearLayout.spans, kv_head_span) for that worker's rank:

  LoRA        A's input columns on row-parallel layers, B's output rows of each fused slice
              on column-parallel ones; B multiplied by its scaling (in B's dtype, as the
              pool does) and the module's scaling then 1
  (IA)^3      input scales of row-parallel layers, output scales of column-parallel ones
  prefix      the rank's KV heads of every layer's keys and values
  bottleneck, prompt   whole (they act on the replicated residual and embeddings)
  head        none: heads live on rank 0 only

Every tensor is cast to the pools' dtype (each pool casts to it when it copies, so the cast
gives the same values) and copied out of the whole tensor, so pickling it sends only its part.
A pool told an adapter is an AdapterShard takes its tensors whole (``linear_part``,
``kv_part``): nothing is cut twice.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from adapterserve.adapters_store.formats.families import Adapter, Ia3Adapter, PrefixAdapter, PromptAdapter
from adapterserve.adapters_store.formats.types import BottleneckAdapter, LoraAdapter, LoraModule
from adapterserve.layers.attention import PagedAttention
from adapterserve.layers.linear import AdapterLinear
from adapterserve.layers.linear_spans import LinearLayout, LinearSpans
from adapterserve.layers.parallel import kv_head_span


@dataclass
class AdapterShard(Adapter):
    """An adapter as rank ``rank`` of ``world_size`` holds it: each tensor its layers split is
    that rank's part already, in the pools' dtype (module docstring)."""

    rank: int = 0
    world_size: int = 1


def linear_part(linear: AdapterLinear, adapter: Adapter) -> LinearSpans:
    """Where this rank's part of ``linear``'s tensors lies in the adapter's: the layer's own
    spans of a whole adapter, all of an AdapterShard's."""
    return linear.spans.local() if isinstance(adapter, AdapterShard) else linear.spans


def kv_part(attention: PagedAttention, adapter: Adapter, t: torch.Tensor) -> torch.Tensor:
    """This rank's KV heads of t [..., kv_heads, head_dim], a prefix tensor of ``adapter``."""
    return t if isinstance(adapter, AdapterShard) else attention.shard_kv(t)


class AdapterCutter:
    """Rank 0's side: ``cutter(adapter, rank)`` is the AdapterShard rank ``rank`` receives.

    linears: every adapter-aware linear (any rank's: their layouts are in full sizes);
    num_kv_heads: the backbone's; dtype: the pools' (the engine's dtype).
    """

    def __init__(self, linears: Iterable[tuple[int, AdapterLinear]], num_kv_heads: int, dtype: torch.dtype,
                 world_size: int) -> None:
        # (layer, module kind) -> its linear's layout and the kind's slice in it
        self.slices: dict[tuple[int, str], tuple[LinearLayout, int]] = {
            (layer, kind): (linear.layout, index)
            for layer, linear in linears for index, kind in enumerate(linear.slice_kinds)}
        self.num_kv_heads, self.dtype, self.world_size = num_kv_heads, dtype, world_size

    def __call__(self, adapter: Adapter, rank: int) -> AdapterShard:
        return AdapterShard(
            adapter.kind, lora=self._lora(adapter.lora, rank), ia3=self._ia3(adapter.ia3, rank),
            prompt=self._prompt(adapter.prompt), prefix=self._prefix(adapter.prefix, rank),
            bottleneck=self._bottleneck(adapter.bottleneck), config=adapter.config, rank=rank,
            world_size=self.world_size)

    def _spans(self, key: tuple[int, str], rank: int) -> tuple[LinearSpans, int]:
        if key not in self.slices:
            raise ValueError(f"the adapter targets {key[1]} of layer {key[0]}, which the backbone has no "
                             "adapter-aware linear for")
        layout, index = self.slices[key]
        return layout.spans(rank, self.world_size), index

    def _lora(self, lora: LoraAdapter | None, rank: int) -> LoraAdapter | None:
        if lora is None:
            return None
        modules = {}
        for key, module in lora.modules.items():
            spans, index = self._spans(key, rank)
            b = spans.output_part(module.b, 0, index) * module.scaling
            modules[key] = LoraModule(self._own(spans.input_part(module.a, 1)), self._own(b), 1.0)
        return LoraAdapter(modules, lora.config)

    def _ia3(self, ia3: Ia3Adapter | None, rank: int) -> Ia3Adapter | None:
        if ia3 is None:
            return None
        scales = {}
        for key, scale in ia3.scales.items():
            spans, index = self._spans(key, rank)
            part = spans.input_part(scale, 0) if key[1] in ia3.feedforward else spans.output_part(scale, 0, index)
            scales[key] = self._own(part)
        return Ia3Adapter(scales, ia3.feedforward)

    def _prefix(self, prefix: PrefixAdapter | None, rank: int) -> PrefixAdapter | None:
        if prefix is None:
            return None
        heads = kv_head_span(self.num_kv_heads, rank, self.world_size)
        return PrefixAdapter(self._own(prefix.keys.narrow(-2, *heads)), self._own(prefix.values.narrow(-2, *heads)))

    def _prompt(self, prompt: PromptAdapter | None) -> PromptAdapter | None:
        return None if prompt is None else PromptAdapter(self._own(prompt.embeddings))

    def _bottleneck(self, bottleneck: BottleneckAdapter | None) -> BottleneckAdapter | None:
        if bottleneck is None:
            return None
        modules = {key: replace(m, down=self._own(m.down), down_bias=self._own(m.down_bias), up=self._own(m.up),
                                up_bias=self._own(m.up_bias))
                   for key, m in bottleneck.modules.items()}
        return BottleneckAdapter(modules, bottleneck.original_ln_before, bottleneck.config)

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """t in the pools' dtype, in storage of its own (a view would pickle its whole base)."""
        return t.to(self.dtype, memory_format=torch.contiguous_format, copy=True)
