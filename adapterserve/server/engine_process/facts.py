"""What a replica knows about its engine without touching it: fixed facts, read once
at start, and the current load, read on demand (by RPC when the engine is elsewhere)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from adapterserve.adapters_store.formats.types import AdapterLimits, BackboneSpec
from adapterserve.adapters_store.servable import ServingRules

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EngineFacts:
    backbone_spec: BackboneSpec
    adapter_limits: AdapterLimits
    encoder: bool  # classify/embed only (an EncoderEngine)
    vocab_size: int
    max_model_len: int
    max_lora_rank: int
    num_kv_blocks: int  # 0 for an encoder
    serving_rules: ServingRules  # what its pools hold: uploads are checked against it
    host_dtype: torch.dtype  # adapters' host copies are kept in the serving dtype

    @classmethod
    def of(cls, engine) -> EngineFacts:
        from adapterserve.engine.encoder_engine import EncoderEngine  # where the engine runs

        encoder = isinstance(engine, EncoderEngine)
        return cls(
            engine.backbone_spec, engine.adapter_limits, encoder, engine.model_config.vocab_size,
            engine.max_length if encoder else engine.max_model_len, engine.config.max_lora_rank,
            0 if encoder else engine.blocks.num_blocks, engine.serving_rules, engine.config.torch_dtype,
        )


@dataclass(frozen=True)
class EngineLoad:
    free_kv_blocks: int = 0
    requests: int = 0  # requests the engine holds (waiting or running)
    waiting: int = 0
    running: int = 0
    broken: str | None = None  # why the engine serves no more requests; None while it serves
    stalled_s: float = 0.0  # seconds its work has gone without progress (0.0 when it has none)

    @classmethod
    def of(cls, engine) -> EngineLoad:
        """The load of a decoder Engine (an EncoderEngine's: LocalEngine.last_load)."""
        scheduler = engine.scheduler
        return cls(engine.blocks.num_free, len(engine.requests), len(scheduler.waiting), len(scheduler.running),
                   engine.broken, engine.seconds_without_progress())
