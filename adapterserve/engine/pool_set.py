"""The device pools of a decoder engine, built the same way on every tensor-parallel
rank: each rank's pools hold its shard of every placed adapter."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np

from adapterserve.config import STACKED_DECODES, EngineConfig
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.pools.bottleneck import BottleneckPools
from adapterserve.engine.pools.head import HeadPool
from adapterserve.engine.pools.ia3 import Ia3Pool
from adapterserve.engine.pools.lora import LoraPool
from adapterserve.engine.pools.prefix import PrefixPool
from adapterserve.engine.pools.prompt import PromptPool
from adapterserve.models.decoder import DecoderModel


@dataclass
class PoolSet:
    lora: LoraPool
    bottleneck: BottleneckPools
    head: HeadPool | None  # rank 0 only: heads read the replicated pooled hidden state
    ia3: Ia3Pool
    prompt: PromptPool
    prefix: PrefixPool

    def all(self) -> list:
        """In placement order (a slot's placement is all of them or none)."""
        pools = [self.lora, self.bottleneck, self.head, self.ia3, self.prompt, self.prefix]
        return [pool for pool in pools if pool is not None]

    @contextmanager
    def for_step(self, family_slots: np.ndarray, mixed: bool = False) -> Iterator[None]:
        """The host state one step sets (family_slots: [3, T] each token's lora, ia3 and
        bottleneck slot): the LoRA rows its adapters cover, the (IA)^3 scales they need (a
        mixed-step graph's: every scale, Ia3Pool.for_step)."""
        with self.lora.for_step(family_slots[0]), self.ia3.for_step(family_slots[1], every=mixed):
            yield

    def graph_signature(self) -> tuple:
        """Per family (lora, ia3, bottleneck): the host state a captured decode graph depends
        on (the bottleneck ops read every slot's widths and activations on the device)."""
        return self.lora.graph_part(), self.ia3.graph_part(), ()

    @contextmanager
    def covering(self, rows: int, tier: str) -> Iterator[None]:
        """Host state as a step covering ``rows`` stacked LoRA rows (0: as they are) with the
        (IA)^3 ``tier`` would set: warm-up captures each such graph in it."""
        with self.lora.covering(rows) if rows else nullcontext(), self.ia3.covering(tier):
            yield


def build_pools(config: EngineConfig, model: DecoderModel, blocks: BlockManager, with_head: bool = True) -> PoolSet:
    """Every family's pool over the model's layers; binds the prompt embeddings to the model.
    ``blocks``: where prefix-tuning KV blocks come from."""
    cfg, hidden = config, model.cfg.hidden_size
    linears = list(model.adapter_linears())
    dtype, device = cfg.torch_dtype, cfg.device
    prompt = PromptPool(cfg.max_loras, cfg.max_virtual_tokens, hidden, dtype, device)
    model.prompt_embeddings = prompt.embeddings
    head = HeadPool(cfg.max_loras, cfg.max_labels, cfg.max_head_layers, hidden, ("last",), dtype, device) \
        if with_head else None
    return PoolSet(
        lora=LoraPool(linears, cfg.max_loras, cfg.pool_rows, cfg.max_lora_rank, dtype, device,
                      stacked=cfg.lora_decode_used in STACKED_DECODES, fused=cfg.lora_decode_used == "fused"),
        bottleneck=BottleneckPools(list(model.layers), hidden, cfg.max_loras, cfg.max_bottleneck_rank,
                                   cfg.max_num_batched_tokens, dtype, device),
        head=head,
        ia3=Ia3Pool(linears, cfg.max_loras, dtype, device),
        prompt=prompt,
        prefix=PrefixPool(blocks, model.attention_layers()),
    )
