"""Engine configuration: one frozen dataclass, checked on construction."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and placement of one engine (one backbone on one device).

    max_loras:        adapter slots on the device (adapters resident at once)
    max_lora_rank:    largest LoRA rank accepted
    lora_pool_rows:   rank rows per projection pool; default max_loras * max_lora_rank.
                      An adapter of rank r takes r rows, so smaller ranks leave room
                      for more adapters when slots outnumber what rows allow.
    block_size:       tokens per KV-cache block
    num_kv_blocks:    KV-cache blocks (shared by all layers' caches)
    max_num_seqs:     requests running at once
    max_num_batched_tokens: tokens in one step (decodes plus prefill chunks; a longer prompt
                      runs in chunks over several steps)
    max_queued_requests: requests waiting to start; beyond it add_request sheds (Overloaded)
    max_model_len:    prompt plus generated tokens per request; default the backbone's
    max_virtual_tokens: longest prompt-tuning / prefix-tuning adapter accepted
    max_labels:       most labels a classification head may have
    max_head_layers:  1, or 2 for heads with a hidden layer (costs [slots, D, D] of memory)
    max_bottleneck_rank: widest bottleneck adapter accepted (hidden / reduction_factor)
    cuda_graphs:      replay decode steps as CUDA graphs (on CUDA devices)
    max_staged_adapters: adapters kept with ready-to-copy (pinned) host copies for fast loads
    lora_side_stream: run each LoRA shrink on a second CUDA stream, beside the base GEMM (CUDA
                      only; measured in BENCHMARKS.md)
    """

    device: str = "cpu"
    dtype: str = "float32"
    max_loras: int = 8
    max_lora_rank: int = 64
    lora_pool_rows: int | None = None
    block_size: int = 16
    num_kv_blocks: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_queued_requests: int = 1024
    max_model_len: int | None = None
    max_virtual_tokens: int = 64
    max_labels: int = 32
    max_head_layers: int = 1
    max_bottleneck_rank: int = 64
    cuda_graphs: bool = True
    max_staged_adapters: int = 32
    lora_side_stream: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_loras", "max_lora_rank", "block_size", "num_kv_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lora_pool_rows is not None and self.lora_pool_rows < self.max_lora_rank:
            raise ValueError(
                f"lora_pool_rows ({self.lora_pool_rows}) must hold at least one adapter of "
                f"max_lora_rank ({self.max_lora_rank})"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def pool_rows(self) -> int:
        return self.lora_pool_rows or self.max_loras * self.max_lora_rank
