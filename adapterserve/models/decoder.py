"""Llama-family causal LM in plain torch: Llama, Mistral, Qwen2, Qwen3.

RMSNorm, RoPE (Llama-3 scaling), grouped-query attention over a paged KV cache,
SwiGLU, optional q/k/v bias (Qwen2) and q/k norm (Qwen3). q/k/v and gate/up are
fused at load; adapters reach the projections through AdapterLinear slices.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from adapterserve.kernels.fp8_fused import silu_mul_quant
from adapterserve.kernels.fused import silu_mul
from adapterserve.layers.attention import PagedAttention
from adapterserve.layers.bottleneck import (
    BottleneckPool,
    bottlenecks_active,
    residual_sublayer,
)
from adapterserve.layers.context import get_context
from adapterserve.layers.linear import AdapterLinear, QuantizedRows, RMSNorm
from adapterserve.models.decoder_config import DecoderConfig
from adapterserve.models.rope import RotaryEmbedding


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, rope: RotaryEmbedding, dtype, device,
                 fp8: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = rope
        h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = AdapterLinear(h, (q, kv, kv), ("q_proj", "k_proj", "v_proj"), cfg.qkv_bias, dtype, device,
                                      fp8)
        self.o_proj = AdapterLinear(q, (h,), ("o_proj",), cfg.o_bias, dtype, device, fp8)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        window = cfg.sliding_windows[layer_idx]
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        inter = cfg.intermediate_size
        self.gate_up_proj = AdapterLinear(h, (inter, inter), ("gate_proj", "up_proj"), cfg.mlp_bias, dtype, device,
                                          fp8)
        self.down_proj = AdapterLinear(inter, (h,), ("down_proj",), cfg.mlp_bias, dtype, device, fp8)
        # bottleneck adapters after attention and after the MLP (pools bound by the engine)
        self.bottleneck_mh: BottleneckPool | None = None
        self.bottleneck_output: BottleneckPool | None = None

    def forward(self, positions: torch.Tensor, pending: torch.Tensor | None, residual: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """residual: [T, D], the residual stream; pending: the previous layer's MLP output
        not yet added to it (None: nothing to add). Each residual add is fused with the
        norm after it; with an FP8 backbone whose kernel rounds activations to e4m3, so is
        the quantization of q|k|v's and gate|up's input (and down's, in SiLU-mul).
        Returns this layer's (pending, residual)."""
        normed, quantized = self._norm(self.input_layernorm, pending, residual, self.qkv_proj)
        attn_out = self.o_proj(self._attention(positions, self.qkv_proj(normed, quantized)))
        normed, quantized = self._close_sublayer(attn_out, residual, self.bottleneck_mh,
                                                 self.post_attention_layernorm, self.gate_up_proj)
        mlp_out = self.down_proj(*self._silu_mul(self.gate_up_proj(normed, quantized)))
        if bottlenecks_active(self.bottleneck_output):  # rows with adapters: added here, unfused
            residual.copy_(residual_sublayer(mlp_out, residual, None, self.bottleneck_output))
            return None, residual
        return mlp_out, residual

    def _attention(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        tokens = qkv.shape[0]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if q.is_cuda:  # RoPE and the KV-cache write in one launch, on the views of qkv
            write_slots = get_context().attention.write_slots
            self.rope.rotate_into_cache(positions, q, k, v, self.attn.k_cache, self.attn.v_cache, write_slots)
            return self.attn(q)
        q, k = self.rope(positions, q, k)
        return self.attn(q, k, v)

    @classmethod
    def _close_sublayer(cls, out: torch.Tensor, residual: torch.Tensor, pool: BottleneckPool | None, norm: RMSNorm,
                        consumer: AdapterLinear) -> tuple[torch.Tensor, QuantizedRows | None]:
        """residual += out (through each row's bottleneck adapter, if any); norm of the sum."""
        if not bottlenecks_active(pool):
            return cls._norm(norm, out, residual, consumer)
        residual.copy_(residual_sublayer(out, residual, None, pool))
        return cls._norm(norm, None, residual, consumer)

    @staticmethod
    def _norm(norm: RMSNorm, pending: torch.Tensor | None, residual: torch.Tensor, consumer: AdapterLinear
              ) -> tuple[torch.Tensor, QuantizedRows | None]:
        """norm(residual) (residual += pending first, unless None), quantized with it when
        ``consumer`` takes e4m3 input this batch."""
        if consumer.takes_quantized_input(residual.shape[0]):
            return norm.quantized(residual) if pending is None else norm.quantized(pending, residual)
        return (norm(residual) if pending is None else norm.add(pending, residual)), None

    def _silu_mul(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, QuantizedRows | None]:
        """silu(gate) * up, quantized with it when down_proj takes e4m3 input this batch."""
        if self.down_proj.takes_quantized_input(gate_up.shape[0]):
            out, q, scale = silu_mul_quant(gate_up)
            return out, (q, scale)
        return silu_mul(gate_up), None


class DecoderModel(torch.nn.Module):
    def __init__(self, cfg: DecoderConfig, max_positions: int, dtype: torch.dtype, device, fp8: bool = False
                 ) -> None:
        """fp8: the layers' linear weights in float8_e4m3fn with per-channel scales; the rest in dtype."""
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, h, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, device=device)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, i, rope, dtype, device, fp8) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.prompt_embeddings: torch.Tensor | None = None  # [S, P, D], bound by the prompt pool
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = torch.nn.Parameter(
                torch.empty(cfg.vocab_size, h, dtype=dtype, device=device), requires_grad=False
            )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        virtual = get_context().virtual
        if virtual is not None:  # prompt tuning: virtual tokens come from the adapter
            hidden[virtual.rows] = self.prompt_embeddings[virtual.slots, virtual.index]
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, D]
        pending, residual = None, self.embed(input_ids)
        for layer in self.layers:
            pending, residual = layer(positions, pending, residual)
        return self.norm(residual) if pending is None else self.norm.add(pending, residual)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [B, D] -> float32 logits [B, V] (written into `out` when given)
        logits = F.linear(hidden, self.lm_head_weight)
        return logits.float() if out is None else out.copy_(logits)

    def adapter_linears(self) -> Iterator[tuple[int, AdapterLinear]]:
        for idx, layer in enumerate(self.layers):
            for module in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                yield idx, module

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.attn for layer in self.layers]
