"""BatchContext: everything one step's layers need besides (input_ids, positions).

Written only by the runner, once per step; read by attention and adapter layers.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.prefill_tiles import PrefillTiles


@dataclass
class AttentionMeta:
    """Where this step's tokens write the paged KV cache and what they read.

    A sequence's context is addressed through its block table: kv index j lives
    in cache slot table[j // page] * page + j % page. Entries before kv_start are
    skipped (a prefix-tuning prefix is right-aligned in its own blocks).

    write_slots:  [T] int64 cache slot each token's k/v is written to
    block_tables: [B, max_pages] int32
    context_lens: [B] int32 kv entries of each sequence after this step's writes
    kv_start:     [B] int32 first valid kv index
    page_size:    tokens per block
    decode:       True when every sequence has exactly one new token (host bool)
    decode_order: [B] int32 the sequences longest context first (decode steps): the decode
                  attention starts its programs in this order
    For steps with prefills (decode False):
    cu_q:         [B + 1] int32 first token row of each sequence's new tokens (cu_seqlens)
    tiles:        query tiles for the paged prefill kernel (no tile straddles sequences)
    """

    write_slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    kv_start: torch.Tensor
    page_size: int
    decode: bool
    decode_order: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    tiles: PrefillTiles | None = None


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
    bottleneck_mix: tuple[int, torch.Tensor] | None = None  # the step's rows' ln_mix: (its pools' ln_mix, [T, 1])


# Per thread, so engines stepping in different threads never see each other's batch.
_local = threading.local()


def set_context(ctx: BatchContext | None) -> None:
    _local.ctx = ctx


def get_context() -> BatchContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("no BatchContext set: the model runs only inside a runner step")
    return ctx
