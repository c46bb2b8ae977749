"""A decoder loaded through the loader at any tensor-parallel rank, every adapter family
placed in its pools, and two steps of one mixed batch run without the engine: a prefill
of every request (virtual tokens and prefixes included), then one decode token each.

Used by the tensor-parallel tests in this rank's process; returns the full-vocab logits
of both steps (identical on every rank). On CUDA the decode step can also be captured in
a CUDA graph (its collectives with it) and replayed."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.read import AdapterLimits, read_adapter
from adapterserve.engine.attention_meta import SequenceLayout, build_attention_meta
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.pools.bottleneck import BottleneckPools
from adapterserve.engine.pools.ia3 import Ia3Pool
from adapterserve.engine.pools.lora import LoraPool
from adapterserve.engine.pools.prefix import PrefixPool
from adapterserve.engine.pools.prompt import PromptPool
from adapterserve.kernels import build_adapter_meta
from adapterserve.layers.context import BatchContext, VirtualTokens, set_context
from adapterserve.layers.parallel import TensorParallel
from adapterserve.models.loader import load_decoder
from tests.helpers.lora import backbone_spec

BLOCK, NUM_BLOCKS, MAX_TOKENS, MAX_RANK = 4, 96, 256, 16


@dataclass
class MixedBatchResult:
    logits: list[torch.Tensor]  # per step: float32 [requests, vocab], on the CPU
    bytes_read: int  # what this rank's loader read from the checkpoint
    param_bytes: int  # what this rank's parameters hold
    graph_logits: torch.Tensor | None = None  # the decode step replayed from a CUDA graph


def prompts(count: int, vocab: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + 2 * i % 7,), generator=gen).tolist() for i in range(count)]


@torch.inference_mode()
def run_mixed_batch(model_dir: Path, adapters: dict[str, Path], tp: TensorParallel, *, fp8_gemm: str | None = None,
                    stacked: bool = False, device: str = "cpu", graph: bool = False) -> MixedBatchResult:
    """One request per adapter plus one base request, in one batch, at ``tp``'s rank."""
    model, cfg = load_decoder(model_dir, torch.float32, device, fp8_gemm=fp8_gemm, tp=tp)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = BlockManager(NUM_BLOCKS, BLOCK)
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(NUM_BLOCKS * BLOCK + 1, attn.num_kv_heads, cfg.head_dim, device=device)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    num_slots = max(len(adapters), 1)
    pools, prefix_pool = _pools(model, blocks, num_slots, stacked, torch.device(device))
    spec = backbone_spec(model_dir)
    spec = type(spec)(spec.model_type, spec.num_layers, spec.hidden_size, spec.linear_shapes, cfg.num_kv_heads,
                      cfg.head_dim)
    placed = [None]
    for slot, (name, path) in enumerate(adapters.items()):
        adapter = read_adapter(path, spec, AdapterLimits(max_lora_rank=MAX_RANK), name=name)
        assert all(pool.place(slot, adapter) for pool in pools), name
        placed.append((slot, adapter))
    batch = _Batch(placed, prompts(len(placed), cfg.vocab_size), blocks, prefix_pool, num_slots)
    logits = [batch.step(model, prefill=True), batch.step(model, prefill=False)]
    replayed = batch.step(model, prefill=False, graph=True) if graph else None
    return MixedBatchResult(logits, _bytes_read(model_dir, tp, fp8_gemm), param_bytes, replayed)


def _bytes_read(model_dir: Path, tp: TensorParallel, fp8_gemm: str | None) -> int:
    """The loader's own count of bytes read for this rank (a second load; cheap at this size)."""
    from adapterserve.models.decoder import DecoderModel
    from adapterserve.models.decoder_config import read_decoder_config
    from adapterserve.models.loader import load_weights

    cfg = read_decoder_config(model_dir)
    model = DecoderModel(cfg, 64, torch.float32, "cpu", fp8=fp8_gemm is not None, tp=tp)
    with torch.no_grad():
        return load_weights(model, model_dir)


def _pools(model, blocks: BlockManager, num_slots: int, stacked: bool, device: torch.device
           ) -> tuple[list, PrefixPool]:
    linears = list(model.adapter_linears())
    hidden, dtype = model.cfg.hidden_size, torch.float32
    prompt = PromptPool(num_slots, 16, hidden, dtype, device)
    model.prompt_embeddings = prompt.embeddings
    prefix = PrefixPool(blocks, model.attention_layers())
    pools = [
        LoraPool(linears, num_slots, 64, MAX_RANK, dtype, device, stacked=stacked),
        Ia3Pool(linears, num_slots, dtype, device),
        BottleneckPools(list(model.layers), hidden, num_slots, 64, MAX_TOKENS, dtype, device),
        prompt,
        prefix,
    ]
    return pools, prefix


class _Batch:
    """The requests' KV blocks and token lists, stepped as the runner steps them."""

    def __init__(self, placed: list, prompt_ids: list[list[int]], blocks: BlockManager, prefix_pool: PrefixPool,
                 num_slots: int) -> None:
        self.requests = []
        for entry, prompt in zip(placed, prompt_ids):
            slot, adapter = entry if entry is not None else (-1, None)
            virtual = adapter.num_virtual if adapter is not None else 0
            prefix_len = adapter.prefix_len if adapter is not None else 0
            own: list[int] = []
            blocks.grow(own, virtual + len(prompt) + 1)
            self.requests.append((slot, adapter, [0] * virtual + prompt, virtual, prefix_len, own))
        self.block_size, self.prefix_pool, self.num_slots = blocks.block_size, prefix_pool, num_slots

    def step(self, model, prefill: bool, graph: bool = False) -> torch.Tensor:
        """The batch's prefill or its decode step; logits on the CPU. graph: the decode step
        captured in a CUDA graph (after an eager run: its KV writes repeat the same values)
        and replayed."""
        ids, positions, layouts, virtual, last_rows, families = [], [], [], ([], [], []), [], ([], [], [])
        for slot, adapter, tokens, num_virtual, prefix_len, own in self.requests:
            start, end = (0, len(tokens)) if prefill else (len(tokens), len(tokens) + 1)
            first_row = len(ids)
            ids += tokens if prefill else [tokens[1]]
            positions += range(prefix_len + start, prefix_len + end)
            pages = self.prefix_pool.pages.get(slot, []) if prefix_len else []
            aligned = len(pages) * self.block_size
            layouts.append(SequenceLayout(pages + own, aligned - prefix_len, aligned + end, end - start))
            last_rows.append(len(ids) - 1)
            if prefill:
                for i in range(num_virtual):
                    for column, value in zip(virtual, (first_row + i, slot, i)):
                        column.append(value)
            for f, held in enumerate(_families(adapter)):
                families[f].extend([slot if held else -1] * (end - start))
        dev = model.embed_tokens.weight.device
        ctx = BatchContext(
            attention=build_attention_meta(layouts, self.block_size, dev),
            lora=None, lora_workspace=torch.empty(3, MAX_TOKENS, MAX_RANK, device=dev),
            logits_rows=torch.tensor(last_rows, device=dev),
            virtual=VirtualTokens(*(torch.tensor(v, device=dev) for v in virtual)) if virtual[0] else None,
        )
        for name, slots in zip(("lora", "ia3", "bottleneck"), families):
            if any(s >= 0 for s in slots):
                setattr(ctx, name, build_adapter_meta(torch.tensor(slots, dtype=torch.int32, device=dev),
                                                      self.num_slots))
        ids, positions = torch.tensor(ids, device=dev), torch.tensor(positions, device=dev)
        set_context(ctx)
        try:
            if not graph:
                return model.compute_logits(model(ids, positions)[ctx.logits_rows]).cpu()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                logits = model.compute_logits(model(ids, positions)[ctx.logits_rows])
            captured.replay()
            return logits.cpu()
        finally:
            set_context(None)


def _families(adapter) -> tuple[bool, bool, bool]:
    """Whether the adapter has LoRA, (IA)^3, bottleneck weights (the per-token families)."""
    if adapter is None:
        return False, False, False
    return adapter.lora is not None, adapter.ia3 is not None, adapter.bottleneck is not None
