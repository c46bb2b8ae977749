"""BERT-family encoder in plain torch: BERT, RoBERTa, MiniLM (BERT's architecture).

Embeddings (word + position + token type, LayerNorm), self-attention over a padded
[B, L] batch with a padding mask (no KV cache), GELU feed-forward, post-LN.
q/k/v are fused at load; adapters reach the projections through AdapterLinear
slices whose kinds are the Hugging Face module paths below ``encoder.layer.<i>.``
(``formats.types.ENCODER_LINEARS``), so PEFT target names map one to one.

Layers work on the flattened batch [T = B * L, D]; the BatchContext's adapter
metadata covers those T tokens, a token's slot being its row's
(``layers.bottleneck.encoder_adapter_meta``). LoRA and (IA)^3 act inside the
AdapterLinears ((IA)^3 on keys and values: ``qkv.ia3_out``; on the FFN activation:
``output.ia3_in``). Bottleneck adapters have two hooks per layer, None until a slot
manager fills them: after the attention output and after the feed-forward output,
each before that sublayer's residual add and LayerNorm.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from adapterserve.adapters_store.formats.types import BackboneSpec
from adapterserve.kernels.reference import ACTIVATIONS
from adapterserve.layers.bottleneck import BottleneckPool, residual_sublayer
from adapterserve.layers.linear import AdapterLinear
from adapterserve.models.encoder_config import EncoderConfig, PoolingConfig

_ACT = {**ACTIVATIONS, "gelu_pytorch_tanh": ACTIVATIONS["gelu_new"]}


def _layer_norm(dim: int, eps: float, dtype, device) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(dim, eps=eps, dtype=dtype, device=device)
    norm.requires_grad_(False)
    return norm


class EncoderEmbeddings(torch.nn.Module):
    def __init__(self, cfg: EncoderConfig, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word = torch.nn.Embedding(cfg.vocab_size, h, dtype=dtype, device=device)
        self.position = torch.nn.Embedding(cfg.max_position_embeddings, h, dtype=dtype, device=device)
        self.token_type = torch.nn.Embedding(cfg.type_vocab_size, h, dtype=dtype, device=device)
        self.norm = _layer_norm(h, cfg.layer_norm_eps, dtype, device)
        self.requires_grad_(False)

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        # BERT: 0..L-1. RoBERTa: non-pad tokens count up from pad_token_id + 1, pads sit at pad_token_id.
        if self.cfg.position_offset is None:
            return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        real = input_ids.ne(self.cfg.pad_token_id).long()
        return torch.cumsum(real, dim=1) * real + self.cfg.pad_token_id

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        # input_ids: [B, L] -> [B, L, D]
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word(input_ids) + self.token_type(types) + self.position(self.positions(input_ids))
        return self.norm(x)


class EncoderLayer(torch.nn.Module):
    def __init__(self, cfg: EncoderConfig, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        h, inter, eps = cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps
        kinds = ("attention.self.query", "attention.self.key", "attention.self.value")
        self.qkv = AdapterLinear(h, (h, h, h), kinds, True, dtype, device)
        self.attn_out = AdapterLinear(h, (h,), ("attention.output.dense",), True, dtype, device)
        self.attn_norm = _layer_norm(h, eps, dtype, device)
        self.intermediate = AdapterLinear(h, (inter,), ("intermediate.dense",), True, dtype, device)
        self.output = AdapterLinear(inter, (h,), ("output.dense",), True, dtype, device)
        self.out_norm = _layer_norm(h, eps, dtype, device)
        self.act = _ACT[cfg.hidden_act]
        # adapter hooks (None: no adapter of that family is loaded)
        self.bottleneck_mh: BottleneckPool | None = None  # after attention output, before its LayerNorm
        self.bottleneck_output: BottleneckPool | None = None  # after FFN output, before its LayerNorm
        # (IA)^3 needs no hook here: keys/values are qkv.ia3_out, the FFN activation is output.ia3_in

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # hidden: [T, D] with T = B * L; mask: [B, 1, 1, L] bool, True where a key is a real token
        d = self.cfg.hidden_size
        qkv = self.qkv(hidden)
        q, k, v = qkv.split([d, d, d], dim=-1)
        context = self._attention(q, k, v, mask)
        hidden = residual_sublayer(self.attn_out(context), hidden, self.attn_norm, self.bottleneck_mh)
        act = self.act(self.intermediate(hidden))
        return residual_sublayer(self.output(act), hidden, self.out_norm, self.bottleneck_output)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # q, k, v: [T, D] -> [B, H, L, hd] -> context [T, D]
        batch, length = mask.shape[0], mask.shape[-1]
        heads, hd = self.cfg.num_heads, self.cfg.head_dim

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(batch, length, heads, hd).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
        return out.transpose(1, 2).reshape(batch * length, heads * hd)


class Pooler(torch.nn.Module):
    """BERT's pooler: tanh(dense(h[CLS]))."""

    def __init__(self, dim: int, dtype, device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(dim, dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(cls, self.weight, self.bias))


class EncoderModel(torch.nn.Module):
    def __init__(self, cfg: EncoderConfig, has_pooler: bool, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = EncoderEmbeddings(cfg, dtype, device)
        self.layers = torch.nn.ModuleList(EncoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.pooler = Pooler(cfg.hidden_size, dtype, device) if has_pooler else None

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # input_ids, attention_mask: [B, L] -> last hidden states [B, L, D]
        batch, length = input_ids.shape
        limit = self.cfg.max_position_embeddings - (self.cfg.position_offset or 0)
        if length > limit:
            raise ValueError(f"inputs of {length} tokens exceed this encoder's {limit} position embeddings")
        mask = attention_mask.bool().view(batch, 1, 1, length)
        hidden = self.embeddings(input_ids, token_type_ids).reshape(batch * length, -1)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return hidden.view(batch, length, -1)

    def pool(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: PoolingConfig | None = None
    ) -> torch.Tensor:
        """Sentence vectors [B, D] from hidden [B, L, D]; default: the checkpoint's own pooling."""
        pooling = pooling or self.cfg.pooling
        if pooling.mode == "mean":
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        elif pooling.mode == "cls":
            pooled = hidden[:, 0]
        elif pooling.mode == "pooler":
            if self.pooler is None:
                raise ValueError("this checkpoint has no pooler weights (pooler.dense); use mean or cls pooling")
            pooled = self.pooler(hidden[:, 0])
        else:
            raise ValueError(f"unknown pooling mode {pooling.mode!r}; expected mean, cls or pooler")
        return F.normalize(pooled, p=2, dim=1) if pooling.normalize else pooled

    def backbone_spec(self) -> BackboneSpec:
        """The shapes adapters are checked against."""
        cfg, shapes = self.cfg, {}
        for _, linear in self.adapter_linears():
            for kind, width in zip(linear.slice_kinds, linear.slice_widths):
                shapes[kind] = (linear.in_features, width)
        return BackboneSpec(cfg.model_type, cfg.num_layers, cfg.hidden_size, shapes, cfg.num_heads, cfg.head_dim)

    def adapter_linears(self) -> Iterator[tuple[int, AdapterLinear]]:
        for idx, layer in enumerate(self.layers):
            for module in (layer.qkv, layer.attn_out, layer.intermediate, layer.output):
                yield idx, module
