"""The device part of a step, the same on every tensor-parallel rank: the step's host
inputs (``StepInputs``, built by rank 0's runner from the scheduled requests) in, the
BatchContext written, the backbone run (eagerly, or as a captured decode or mixed-step graph), the
logits of the sampling rows out.

Rank 0 samples from the logits; the ids it keeps in ``sampled`` (the next step's
inputs read them there) are broadcast to the other ranks' ``sampled``, so every rank
feeds the same ids to the next step without the host seeing them.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from adapterserve.config import EngineConfig
from adapterserve.engine.adapter_host import TOKEN_FAMILIES
from adapterserve.engine.attention_meta import (
    SequenceLayout,
    build_attention_meta,
    layout_columns,
    layouts_from_columns,
)
from adapterserve.engine.host_copy import to_device
from adapterserve.kernels import build_adapter_meta
from adapterserve.kernels.attention import attention_in_chain, forced_splits, forced_tiles
from adapterserve.kernels.kv_fp8 import copy_rows
from adapterserve.kernels.pdl import ENV, pdl_mode, prefetch_setting, set_pdl, set_prefetch
from adapterserve.kernels.stacked import RowsInUse, expand_for_slots
from adapterserve.layers.base_gemm import DECODE_FP8
from adapterserve.layers.context import BatchContext, VirtualTokens, set_context
from adapterserve.layers.parallel import SINGLE, TensorParallel
from adapterserve.models.decoder import DecoderModel


def attach_lora_side_stream(model: DecoderModel, device: str) -> None:
    """One CUDA stream beside the compute stream for every adapter linear's LoRA shrink
    (used in decode steps; EngineConfig.lora_side_stream)."""
    side = torch.cuda.Stream(device=device)
    for _, linear in model.adapter_linears():
        linear.side_stream = side


def use_decode_gemm(model: DecoderModel, kernel: str, device: str) -> None:
    """Every adapter linear's decode base product through ``kernel`` (EngineConfig.decode_gemm);
    on a GPU the split-K counters our kernels need are allocated now, before any graph capture."""
    for _, linear in model.adapter_linears():
        linear.decode_gemm = kernel
    if torch.device(device).type == "cuda":
        from adapterserve.kernels.split_counters import prepare_split_counters

        prepare_split_counters(device)


def use_attention_dots(model: DecoderModel, dots: str) -> None:
    """Every attention layer's decode products as EngineConfig.decode_attention_dots says."""
    for attn in model.attention_layers():
        attn.decode_dots = dots


def use_fp8_gemm(model: DecoderModel, kernel: str) -> None:
    """Every FP8 linear's base product through ``kernel`` (EngineConfig.fp8_gemm), whatever
    the model was loaded with."""
    for _, linear in model.adapter_linears():
        if linear.weight_scale is not None:
            linear.fp8_gemm = kernel


def use_kernel_options(model: DecoderModel, config: EngineConfig) -> None:
    """The kernels a rank's decode steps run, as the config says: the base products
    (decode_gemm, fp8_gemm), decode attention's products and this process's PDL mode."""
    use_decode_gemm(model, config.decode_gemm, config.device)
    use_fp8_gemm(model, config.fp8_gemm)
    use_attention_dots(model, config.decode_attention_dots)
    apply_pdl(config)


def pdl_for(config: EngineConfig) -> str | None:
    """The PDL mode EngineConfig.pdl asks for; None: ADAPTERSERVE_PDL's ("auto" with it set).
    "auto" otherwise launches early where the decode step's products run our Triton kernels,
    whose launches PDL overlaps: an FP8 backbone on CUDA on our decode GEMM, and any backbone
    whose decode LoRA runs the fused linear (kernels/stacked_fused.py; its one-adapter step
    was 4.6% faster early on the H200 8B, base steps alike: BENCHMARKS.md)."""
    if config.pdl != "auto":
        return config.pdl
    if ENV in os.environ:
        return None
    on_gpu = torch.device(config.device).type == "cuda"
    ours = config.fp8 and config.fp8_gemm in ("auto", *DECODE_FP8) or config.lora_decode_used == "fused"
    return "early" if on_gpu and ours else "off"


def apply_pdl(config: EngineConfig) -> None:
    """Set this process's PDL mode and weight prefetch as EngineConfig.pdl and .weight_prefetch
    say (process-wide; the kernels read them at launch, so the graphs captured after keep them);
    a bad ADAPTERSERVE_PDL, ADAPTERSERVE_PREFETCH or ADAPTERSERVE_ATTENTION_* (PDL, TILES, SPLITS)
    is refused here, before any step."""
    set_pdl(pdl_for(config))
    set_prefetch(config.weight_prefetch)
    pdl_mode()  # each raises on a bad environment value
    prefetch_setting()
    attention_in_chain()
    forced_tiles()
    forced_splits()


def with_sampled_ids(ids: torch.Tensor, sources: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Input ids from the host, each row whose source is >= 0 taking the id the step
    before sampled into that row of ``sampled`` (a token not yet on the host)."""
    return torch.where(sources >= 0, sampled[sources.clamp(min=0)], ids)


@dataclass
class StepInputs:
    """One step's host inputs: plain lists and arrays, picklable (rank 0 sends them to the
    other ranks as they are). Token-level lists have one entry per token of the step."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    layouts: list[SequenceLayout] = field(default_factory=list)  # per request
    slots: list[int] = field(default_factory=list)  # per token: its adapter slot, -1 for none
    last_rows: list[int] = field(default_factory=list)  # per request: its last token's row
    sources: list[int] = field(default_factory=list)  # per token: row of `sampled` holding its id, or -1
    virtual: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))
    family_slots: np.ndarray | None = None  # [len(TOKEN_FAMILIES), T]: slots per family, -1 where unused
    generating: list[int] = field(default_factory=list)  # requests that sample a token, in logits order
    graph: bool = False  # replay a decode graph (every request decodes one token and samples)
    mixed: bool = False  # replay a mixed-step graph (MixedGraphs: a step with prefill tokens)
    signature: tuple = ()  # host state a graph depends on (DecodeGraphs.run, MixedGraphs.run)

    @property
    def families(self) -> tuple[bool, ...]:
        """Whether any token uses each of TOKEN_FAMILIES."""
        return tuple((self.family_slots >= 0).any(axis=1).tolist())

    def __getstate__(self) -> dict:
        """Pickled with the layouts as columns (rank 0 pickles a step's inputs every step)."""
        return {**self.__dict__, "layouts": layout_columns(self.layouts)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, layouts=layouts_from_columns(state["layouts"]))


class StepDevice:
    """A rank's device state for steps: KV caches, LoRA workspace, last sampled ids, graphs."""

    def __init__(self, model: DecoderModel, num_cache_slots: int, block_size: int, num_slots: int, max_rank: int,
                 max_tokens: int, tp: TensorParallel = SINGLE, kv_fp8: bool = False) -> None:
        """num_cache_slots: KV entries per layer (the last one: trash for padding rows);
        kv_fp8: the caches in e4m3 with per-(token, head) scales (EngineConfig.kv_cache_dtype)."""
        self.model, self.block_size, self.num_slots, self.tp = model, block_size, num_slots, tp
        param = model.embed_tokens.weight
        self.device, self.dtype = param.device, param.dtype
        if kv_fp8 and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or later (float8 "
                             f"conversions); {torch.cuda.get_device_name(self.device)} has "
                             f"{torch.cuda.get_device_capability(self.device)}")
        for attn in model.attention_layers():  # this rank's KV heads
            attn.allocate_cache(num_cache_slots, self.dtype, self.device, kv_fp8)
        self.trash_slot = num_cache_slots - 1
        self.lora_workspace = torch.empty(3, max_tokens, max(max_rank, 1), dtype=self.dtype, device=self.device)
        self.sampled = torch.zeros(max_tokens, dtype=torch.long, device=self.device)  # last step's token ids
        self.graphs = None  # DecodeGraphs, set by enable_cuda_graphs
        self.mixed_graphs = None  # MixedGraphs, set by enable_cuda_graphs with mixed_tokens

    def enable_cuda_graphs(self, max_batch: int, max_pages: int, mixed_tokens: int = 0, max_requests: int = 0
                           ) -> None:
        """Decode graphs of up to max_batch rows; with mixed_tokens, graphs for steps with
        prefills of up to that many tokens over up to max_requests requests (one memory pool)."""
        from adapterserve.engine.graph_capture import GraphPool
        from adapterserve.engine.graphs import DecodeGraphs
        from adapterserve.engine.mixed_graphs import MixedGraphs

        pool = GraphPool()
        self.graphs = DecodeGraphs(self, max_batch, max_pages, self.trash_slot, pool)
        if mixed_tokens:
            self.mixed_graphs = MixedGraphs(self, mixed_tokens, max_requests or max_batch, max_pages,
                                            self.trash_slot, pool)

    def release_graphs(self, wait: bool) -> None:
        """Drop the captured graphs and their memory pool now (the step then runs eagerly).
        NCCL does not tear a communicator down while a CUDA graph that captured its
        collectives lives: a tensor-parallel rank calls this before it leaves its group.
        ``wait``: then wait for the device to finish its work; never for a broken group, whose
        stream may be stuck (CUDA frees a graph still running when its run ends)."""
        self.graphs = self.mixed_graphs = None
        gc.collect()  # the graphs' own reference cycles, if any
        if wait and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(float32 logits of the generating requests [G, V] or None, the hidden state of every
        request's last row [B, D], or None after a graph replay)."""
        if inputs.graph:
            return self.graphs.run(inputs, inputs.family_slots, inputs.families, inputs.signature), None
        if inputs.mixed:
            return self.mixed_graphs.run(inputs), None
        input_ids, positions, ctx = self._device_batch(inputs)
        set_context(ctx)
        try:
            last = self.model(input_ids, positions)[ctx.logits_rows]
        finally:
            set_context(None)
        logits = self.model.compute_logits(last[inputs.generating]) if inputs.generating else None
        return logits, last

    @torch.inference_mode()
    def keep_sampled(self, tokens: torch.Tensor | None, count: int) -> None:
        """Rank 0: keep the step's `count` sampled ids (tokens) for the next step's inputs and
        broadcast them; other ranks: receive them (tokens None)."""
        if tokens is not None:
            self.sampled[:count].copy_(tokens)
        if self.tp.world_size > 1 and count:
            dist.broadcast(self.sampled[:count], src=0, group=self.tp.group)

    @torch.inference_mode()
    def copy_blocks(self, sources: list[int], copies: list[int]) -> None:
        """KV block sources[i] copied into copies[i] in every layer, all of a step's copies in
        one gather and one scatter per cache."""
        offsets = np.arange(self.block_size)
        rows = [(np.asarray(blocks)[:, None] * self.block_size + offsets).reshape(-1) for blocks in (sources, copies)]
        src, dst = (to_device(r, self.device, torch.long) for r in rows)
        for attn in self.model.attention_layers():
            for cache in attn.cache_tensors():
                copy_rows(cache, dst, cache.index_select(0, src))

    def _device_batch(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, BatchContext]:
        dev = self.device
        ctx = BatchContext(
            attention=build_attention_meta(inputs.layouts, self.block_size, torch.device(dev)),
            lora=None,
            lora_workspace=self.lora_workspace,
            logits_rows=to_device(inputs.last_rows, dev, torch.long),
            virtual=self._virtual(inputs),
        )
        stacked = self._rows_in_use()  # the step's row bucket (LoraPool.for_step set it)
        for family, slots in zip(TOKEN_FAMILIES, inputs.family_slots):
            if (slots >= 0).any():
                expand = (expand_for_slots(slots, stacked.fused_rows, rows=stacked.rows)
                          if family == "lora" and stacked is not None else "tiled")
                setattr(ctx, family, build_adapter_meta(to_device(slots, dev), self.num_slots, stacked_expand=expand))
        ids, sources = (to_device(v, dev, torch.long) for v in (inputs.ids, inputs.sources))
        return with_sampled_ids(ids, sources, self.sampled), to_device(inputs.positions, dev, torch.long), ctx

    @property
    def fused_rows(self) -> int:
        """The largest row bucket in which steps with few adapters run the fused stacked linear
        (lora_decode="fused"; 0: never)."""
        stacked = self._rows_in_use()
        return 0 if stacked is None else stacked.fused_rows

    def _rows_in_use(self) -> RowsInUse | None:
        """The stacked LoRA layout's shared row state, where the pool stacks A rows (bound after
        this object is built: a step's expand is then chosen from its distinct adapters)."""
        stacked = next(self.model.adapter_linears())[1].stacked
        return None if stacked is None else stacked.rows_in_use

    def _virtual(self, inputs: StepInputs) -> VirtualTokens | None:
        if not inputs.virtual[0]:
            return None
        rows, slots, index = (to_device(v, self.device, torch.long) for v in inputs.virtual)
        return VirtualTokens(rows, slots, index)
