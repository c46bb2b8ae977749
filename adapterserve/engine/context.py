"""BatchContext: everything one step's layers need besides (input_ids, positions).

Written only by the runner, once per step; read by attention and adapter layers.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from adapterserve.kernels.metadata import AdapterBatchMeta


@dataclass
class AttentionMeta:
    """Where this step's tokens read and write the paged KV cache.

    Tokens of one sequence are contiguous in the batch. Sequences are padded to
    a common query length and context length for batched attention.

    write_slots:  [T] int64 flat KV-cache slot each token's k/v is written to
    kv_slots:     [B, Kmax] int64 flat slots of every sequence's context (padded)
    mask:         [B, 1, Qmax, Kmax] bool, True where a query may attend a key
    query_pad:    [B, Qmax] int64 token index of each padded query (padding: 0)
    token_pad:    [T] int64 position of each token in the flattened [B * Qmax] queries
    """

    write_slots: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    query_pad: torch.Tensor
    token_pad: torch.Tensor
    sliding_masks: dict[int, torch.Tensor] | None = None  # window -> mask, for windowed layers

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None or self.sliding_masks is None:
            return self.mask
        return self.sliding_masks[window]


@dataclass
class VirtualTokens:
    """Rows of the batch whose input embedding comes from an adapter, not a token id.

    rows:   [M] int64 token rows in the batch
    slots:  [M] int64 adapter slot of each row
    index:  [M] int64 virtual-token index within that adapter's embeddings
    """

    rows: torch.Tensor
    slots: torch.Tensor
    index: torch.Tensor


@dataclass
class BatchContext:
    """One step's metadata.

    attention:      KV-cache reads and writes
    lora, ia3, bottleneck: tokens grouped by adapter slot, per family; a token's
                    slot is -1 in a family its adapter does not use (None: no token uses it)
    virtual:        prompt-tuning rows to take from the prompt pool (None: none)
    lora_workspace: [3, Tmax, max_rank] scratch for LoRA shrink outputs
    logits_rows:    [B] index of each sequence's last token (the rows to sample)
    """

    attention: AttentionMeta | None
    lora: AdapterBatchMeta | None
    lora_workspace: torch.Tensor | None
    logits_rows: torch.Tensor | None
    ia3: AdapterBatchMeta | None = None
    bottleneck: AdapterBatchMeta | None = None
    virtual: VirtualTokens | None = None


# Per thread, so engines stepping in different threads never see each other's batch.
_local = threading.local()


def set_context(ctx: BatchContext | None) -> None:
    _local.ctx = ctx


def get_context() -> BatchContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("no BatchContext set: the model runs only inside a runner step")
    return ctx
