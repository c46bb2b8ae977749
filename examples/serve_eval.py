"""Held-out accuracy of an AdapterHub bottleneck adapter + head through adapterserve's own encoder.

The served path, without the engine: ``read_adapterhub`` reads the files, the
encoder applies the bottleneck through the kernels' op, the head runs on the pooled
output. Used by train_tasks.py to check it agrees with the adapters library.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from adapterserve.adapters_store.formats.adapterhub import read_adapterhub
from adapterserve.adapters_store.formats.types import ClassifierHead
from adapterserve.engine.context import BatchContext, set_context
from adapterserve.kernels.reference import ACTIVATIONS
from adapterserve.models.encoder import EncoderModel
from adapterserve.models.encoder_adapters import add_bottleneck_pools, encoder_adapter_meta, load_bottleneck

BATCH = 64


def head_logits(model: EncoderModel, head: ClassifierHead, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, labels] of a classifier head on hidden [B, L, D]."""
    if head.pooling == "pooler":
        x = model.pooler(hidden[:, 0])
    elif head.pooling == "cls":
        x = hidden[:, 0]
    else:
        x = model.pool(hidden, mask)
    for layer in head.layers:
        x = F.linear(x, layer.weight, layer.bias)
        x = ACTIVATIONS[layer.activation](x) if layer.activation else x
    return x


@torch.no_grad()
def bottleneck_accuracy(model: EncoderModel, tokenizer, adapter_dir: Path, data: list[tuple[str, int]]) -> float:
    adapter = read_adapterhub(adapter_dir, model.backbone_spec(), max_rank=64)
    d = model.cfg.hidden_size
    add_bottleneck_pools(model.layers, d, num_slots=1, max_rank=adapter.rank, max_tokens=BATCH * model.cfg.max_seq_length,
                         dtype=torch.float32, device="cpu")
    load_bottleneck(model.layers, 0, adapter)
    right = 0
    try:
        for start in range(0, len(data), BATCH):
            chunk = data[start : start + BATCH]
            enc = tokenizer([t for t, _ in chunk], padding=True, truncation=True,
                            max_length=model.cfg.max_seq_length, return_tensors="pt")
            mask = enc["attention_mask"]
            meta = encoder_adapter_meta(torch.zeros(len(chunk), dtype=torch.int32), mask, num_slots=1)
            set_context(BatchContext(attention=None, lora=None, lora_workspace=None, logits_rows=None, bottleneck=meta))
            logits = head_logits(model, adapter.head, model(enc["input_ids"], mask), mask)
            right += int((logits.argmax(-1) == torch.tensor([y for _, y in chunk])).sum())
    finally:
        set_context(None)
        for layer in model.layers:
            layer.bottleneck_mh = layer.bottleneck_output = None
    return right / len(data)
