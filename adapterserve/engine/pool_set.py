"""The device pools of a decoder engine, built the same way on every tensor-parallel
rank: each rank's pools hold its shard of every placed adapter."""
from __future__ import annotations

from dataclasses import dataclass

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
