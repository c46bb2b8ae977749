"""EncoderEngine: a BERT-family backbone serving classify and embed requests for
many adapters in one batch (LoRA, (IA)^3, Houlsby/Pfeiffer bottlenecks, heads).

    engine = EncoderEngine.from_pretrained(default_encoder_dir())
    engine.load_adapter("sentiment", "examples/adapters/sentiment-lora")
    engine.classify(["great film", "dull"], ["sentiment", "sentiment"])

Requests are batched by a token budget; each batch runs the encoder once, every
row with its own adapter, then pools and classifies each row by its own head.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.types import BackboneSpec
from adapterserve.config import EngineConfig
from adapterserve.engine.adapter_host import TOKEN_FAMILIES, AdapterHost, family_slots
from adapterserve.engine.pools.bottleneck import BottleneckPools
from adapterserve.engine.pools.head import HeadPool
from adapterserve.engine.pools.ia3 import Ia3Pool
from adapterserve.engine.pools.lora import LoraPool
from adapterserve.engine.request import ClassifyOutput, EmbedOutput
from adapterserve.engine.slots import AdapterSlots
from adapterserve.engine.host_threads import apply_host_threads
from adapterserve.errors import AdapterNotFound, CapacityError, RequestError
from adapterserve.layers.bottleneck import encoder_adapter_meta
from adapterserve.layers.context import BatchContext, set_context
from adapterserve.models.encoder import EncoderModel
from adapterserve.models.encoder_config import PoolingConfig
from adapterserve.models.encoder_loader import load_encoder


class EncoderEngine(AdapterHost):
    serves_virtual_tokens = False  # prompt and prefix tuning are for decoders

    def __init__(self, model: EncoderModel, tokenizer, config: EngineConfig) -> None:
        super().__init__()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.model_config = model.cfg
        dtype, device, slots = config.torch_dtype, config.device, config.max_loras
        linears = list(model.adapter_linears())
        hidden = model.cfg.hidden_size
        self.head_pool = HeadPool(slots, config.max_labels, 2, hidden, ("cls", "pooler", "mean"), dtype, device)
        self.bottleneck_pools = BottleneckPools(list(model.layers), hidden, slots, config.max_bottleneck_rank,
                                                config.max_num_batched_tokens, dtype, device)
        self.slots = AdapterSlots(slots, [
            LoraPool(linears, slots, config.pool_rows, config.max_lora_rank, dtype, device),
            Ia3Pool(linears, slots, dtype, device), self.bottleneck_pools, self.head_pool,
        ])
        self.workspace = torch.empty(3, config.max_num_batched_tokens, config.max_lora_rank, dtype=dtype, device=device)
        self.max_length = min(model.cfg.max_seq_length, config.max_num_batched_tokens)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "cpu", dtype: str = "float32",
                        max_lora_rank: int = 64, **overrides) -> "EncoderEngine":
        from transformers import AutoTokenizer

        config = EngineConfig(device=device, dtype=dtype, max_lora_rank=max_lora_rank, **overrides)
        if config.fp8:
            raise ValueError(f"dtype fp8 is for Llama-family decoders; {model_dir} is an encoder: "
                             "use bfloat16, float16 or float32")
        apply_host_threads(config, 1)
        model, _ = load_encoder(model_dir, config.torch_dtype, device)
        return cls(model, AutoTokenizer.from_pretrained(str(model_dir)), config)

    @property
    def backbone_spec(self) -> BackboneSpec:
        spec = self.model.backbone_spec()
        return dataclasses.replace(spec, layers_prefix=f"{spec.model_type}.encoder.layer")

    # requests

    def classify(self, texts: Sequence[str], adapter_ids: Sequence[str] | str) -> list[ClassifyOutput]:
        """Label each text with its adapter's head, rows of different adapters batched together."""
        ids = _per_text(texts, adapter_ids)
        with self._lock:
            for adapter_id in set(ids):
                adapter = self._adapter(adapter_id)
                if adapter.head is None:
                    raise RequestError(f"adapter {adapter_id!r} has no classification head; classify needs one")
            return self._run(list(texts), ids, self._classify_rows)

    def embed(self, texts: Sequence[str], adapter_ids: Sequence[str | None] | str | None = None) -> list[EmbedOutput]:
        """Sentence vectors with the checkpoint's own pooling (MiniLM: mean, L2-normalised)."""
        ids = _per_text(texts, adapter_ids)
        with self._lock:
            for adapter_id in set(ids) - {None}:
                self._adapter(adapter_id)
            return self._run(list(texts), ids, self._embed_rows)

    def generate(self, *args, **kwargs):
        raise RequestError(f"this backbone is an encoder ({self.model_config.model_type}): use classify or embed")

    stream = push_stream = generate

    def _adapter(self, adapter_id: str | None):
        if adapter_id is None:
            raise RequestError("classify needs an adapter with a classification head")
        if adapter_id not in self.adapters:
            raise AdapterNotFound(f"no adapter {adapter_id!r} is loaded; loaded: {self.list_adapters()}")
        return self.adapters[adapter_id]

    def _run(self, texts: list[str], ids: list[str | None], finish) -> list:
        results: list = [None] * len(texts)
        for rows in self._batches(texts, ids):
            slots: list[int] = []
            try:
                self._pin([ids[i] for i in rows], slots)
                outputs = finish(*self._forward([texts[i] for i in rows], slots), slots, [ids[i] for i in rows])
            finally:
                for slot in slots:
                    if slot >= 0:
                        self.slots.release(slot)
            for i, out in zip(rows, outputs):
                results[i] = out
        return results

    def _batches(self, texts: list[str], ids: list[str | None]) -> list[list[int]]:
        """Row groups under the token budget whose unpinned adapters fit the unpinned slots."""
        lengths = [min(len(self.tokenizer(t).input_ids), self.max_length) for t in texts]
        room = self.config.max_loras - self.slots.num_pinned
        batches, rows, adapters, longest = [], [], set(), 0
        for i, (n, adapter) in enumerate(zip(lengths, ids)):
            new_adapters = adapters | ({adapter} - {None} - self.slots.pinned)
            if rows and (max(longest, n) * (len(rows) + 1) > self.config.max_num_batched_tokens
                         or len(new_adapters) > room):
                batches.append(rows)
                rows, new_adapters, longest = [], {adapter} - {None} - self.slots.pinned, 0
            rows.append(i)
            adapters, longest = new_adapters, max(longest, n)
        return batches + [rows] if rows else batches

    def _pin(self, ids: list[str | None], slots: list[int]) -> None:
        """Each row's slot, held once per row (appended to ``slots`` as held); placing one
        never evicts another adapter of the batch."""
        batch = set(ids)
        for adapter_id in ids:
            slot = -1 if adapter_id is None else self._acquire_slot(adapter_id, batch)
            if slot is None:
                raise CapacityError(f"no room in the adapter pools for {adapter_id!r} beside this batch's others; "
                                   "raise max_loras or lora_pool_rows")
            slots.append(slot)

    @torch.inference_mode()
    def _forward(self, texts: list[str], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.config.device
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        mask = enc["attention_mask"].to(dev)
        metas = {}
        for family, row_slots in zip(TOKEN_FAMILIES, family_slots(slots, self._families_of)):
            if (row_slots >= 0).any():
                metas[family] = encoder_adapter_meta(torch.from_numpy(row_slots).to(dev), mask, self.config.max_loras)
        set_context(BatchContext(attention=None, lora_workspace=self.workspace, logits_rows=None, **{
            "lora": metas.get("lora"), "ia3": metas.get("ia3"), "bottleneck": metas.get("bottleneck")}))
        try:
            types = enc.get("token_type_ids")
            hidden = self.model(enc["input_ids"].to(dev), mask, None if types is None else types.to(dev))
        finally:
            set_context(None)
        return hidden, mask

    def _classify_rows(self, hidden, mask, slots: list[int], ids: list[str]) -> list[ClassifyOutput]:
        pooled = torch.empty(hidden.shape[0], hidden.shape[-1], device=hidden.device, dtype=torch.float32)
        for mode in {self.head_pool.heads[s].pooling for s in slots}:
            rows = [i for i, s in enumerate(slots) if self.head_pool.heads[s].pooling == mode]
            index = torch.tensor(rows, device=hidden.device)
            pooled[index] = self.model.pool(hidden[index], mask[index], PoolingConfig(mode, False)).float()
        probs = self.head_pool.logits(pooled, slots).softmax(-1)
        outputs = []
        for i, (slot, adapter_id) in enumerate(zip(slots, ids)):
            head = self.head_pool.heads[slot]
            values = probs[i, : head.num_labels].tolist()
            best = max(range(head.num_labels), key=values.__getitem__)
            labels = [head.id2label[j] for j in range(head.num_labels)]
            outputs.append(ClassifyOutput(f"classify-{i}", labels[best], best, values, labels, adapter_id))
        return outputs

    def _embed_rows(self, hidden, mask, slots: list[int], ids: list[str | None]) -> list[EmbedOutput]:
        vectors = self.model.pool(hidden, mask).float()
        return [EmbedOutput(f"embed-{i}", v.tolist(), a) for i, (v, a) in enumerate(zip(vectors, ids))]


def _per_text(texts, adapter_ids) -> list:
    if isinstance(texts, str):
        raise RequestError("pass a list of texts; use [text] for one")
    if adapter_ids is None or isinstance(adapter_ids, str):
        return [adapter_ids] * len(texts)
    ids = list(adapter_ids)
    if len(ids) != len(texts):
        raise RequestError(f"adapter_ids has {len(ids)} entries for {len(texts)} texts")
    return ids
