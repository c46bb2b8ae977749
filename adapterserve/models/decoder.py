"""Llama-family causal LM in plain torch: Llama, Mistral, Qwen2, Qwen3.

RMSNorm, RoPE (Llama-3 scaling), grouped-query attention over a paged KV cache,
SwiGLU, optional q/k/v bias (Qwen2) and q/k norm (Qwen3). q/k/v and gate/up are
fused at load; adapters reach the projections through AdapterLinear slices.

Tensor parallel over ``tp``'s ranks (layers/parallel.py): q|k|v and gate|up column-parallel,
o and down row-parallel (one all-reduce each), each rank its query heads and the KV heads
they read (and their KV cache; one KV head replicated on several ranks when there are
fewer KV heads than ranks), the embedding and lm_head split by vocabulary rows. The
residual stream, norms, bottleneck adapters and prompt embeddings are replicated; logits
are gathered whole on every rank.
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
    add_bottlenecks,
    bottlenecks_active,
)
from adapterserve.layers.context import get_context
from adapterserve.layers.linear import AdapterLinear, QuantizedRows, RMSNorm
from adapterserve.layers.parallel import SINGLE, TensorParallel
from adapterserve.models.decoder_config import DecoderConfig
from adapterserve.models.rope import RotaryEmbedding


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, rope: RotaryEmbedding, dtype, device,
                 fp8: bool = False, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = rope
        h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = AdapterLinear(h, (q, kv, kv), ("q_proj", "k_proj", "v_proj"), cfg.qkv_bias, dtype, device,
                                      fp8, "column", tp, (None, cfg.num_kv_heads, cfg.num_kv_heads))
        self.o_proj = AdapterLinear(q, (h,), ("o_proj",), cfg.o_bias, dtype, device, fp8, "row", tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        window = cfg.sliding_windows[layer_idx]
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        inter = cfg.intermediate_size
        self.gate_up_proj = AdapterLinear(h, (inter, inter), ("gate_proj", "up_proj"), cfg.mlp_bias, dtype, device,
                                          fp8, "column", tp)
        self.down_proj = AdapterLinear(inter, (h,), ("down_proj",), cfg.mlp_bias, dtype, device, fp8, "row", tp)
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
        # each linear's input is a fresh output read by it alone: (IA)^3 input scales go on it in place
        normed, quantized = self._norm(self.input_layernorm, pending, residual, self.qkv_proj)
        qkv = self.qkv_proj(normed, quantized, scratch_input=True)
        attn_out = self.o_proj(self._attention(positions, qkv), scratch_input=True)
        normed, quantized = self._close_sublayer(attn_out, residual, self.bottleneck_mh,
                                                 self.post_attention_layernorm, self.gate_up_proj)
        gate_up = self.gate_up_proj(normed, quantized, scratch_input=True)
        mlp_out = self.down_proj(*self._silu_mul(gate_up), scratch_input=True)
        if bottlenecks_active(self.bottleneck_output):  # rows with adapters: their updates added into mlp_out
            add_bottlenecks(mlp_out, residual, self.bottleneck_output)
        return mlp_out, residual

    def _attention(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        cfg, attn = self.cfg, self.attn  # attn's head counts: this rank's
        tokens = qkv.shape[0]
        q, k, v = qkv.split(list(self.qkv_proj.slice_widths), dim=-1)
        q = q.reshape(tokens, attn.num_heads, cfg.head_dim)
        k = k.reshape(tokens, attn.num_kv_heads, cfg.head_dim)
        v = v.reshape(tokens, attn.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if q.is_cuda:  # RoPE and the KV-cache write in one launch, on the views of qkv
            write_slots = get_context().attention.write_slots
            self.rope.rotate_into_cache(positions, q, k, v, self.attn, write_slots)
            return self.attn(q)
        q, k = self.rope(positions, q, k)
        return self.attn(q, k, v)

    @classmethod
    def _close_sublayer(cls, out: torch.Tensor, residual: torch.Tensor, pool: BottleneckPool | None, norm: RMSNorm,
                        consumer: AdapterLinear) -> tuple[torch.Tensor, QuantizedRows | None]:
        """residual += out (through each row's bottleneck adapter, if any); norm of the sum."""
        if bottlenecks_active(pool):
            add_bottlenecks(out, residual, pool)
        return cls._norm(norm, out, residual, consumer)

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


def check_shardable(cfg: DecoderConfig, world_size: int) -> None:
    """ValueError naming every size of cfg that a tensor-parallel world size does not divide."""
    n = world_size
    sizes = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
             "vocab_size": cfg.vocab_size}
    bad = [f"{name}={size} must divide by {n}" for name, size in sizes.items() if size % n]
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        bad.append(f"num_key_value_heads={cfg.num_kv_heads} must divide by {n} or divide it (replicated KV heads)")
    if bad:
        raise ValueError(f"a {cfg.model_type} decoder cannot be split over {n} tensor parallel ranks: "
                         f"{'; '.join(bad)}")


class DecoderModel(torch.nn.Module):
    def __init__(self, cfg: DecoderConfig, max_positions: int, dtype: torch.dtype, device, fp8: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        """fp8: the layers' linear weights in float8_e4m3fn with per-channel scales; the rest in dtype.
        tp: this rank's place in a tensor-parallel group; parameters are then this rank's shards."""
        super().__init__()
        check_shardable(cfg, tp.world_size)
        self.cfg = cfg
        self.tp = tp
        h = cfg.hidden_size
        self.vocab_start, vocab_local = tp.span(cfg.vocab_size, "vocab_size")
        self.embed_tokens = torch.nn.Embedding(vocab_local, h, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, device=device)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, i, rope, dtype, device, fp8, tp) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.prompt_embeddings: torch.Tensor | None = None  # [S, P, D], bound by the prompt pool
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = torch.nn.Parameter(
                torch.empty(vocab_local, h, dtype=dtype, device=device), requires_grad=False
            )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self._embed_tokens(input_ids)
        virtual = get_context().virtual
        if virtual is not None:  # prompt tuning: virtual tokens come from the adapter
            hidden[virtual.rows] = self.prompt_embeddings[virtual.slots, virtual.index]
        return hidden

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, D]; split by vocabulary: each rank looks up the ids in its
        rows (zeros for the others) and one all-reduce sums them."""
        if self.tp.world_size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        hidden = self.embed_tokens(torch.where(mine, local, 0))
        hidden.mul_(mine.unsqueeze(-1).to(hidden.dtype))
        return self.tp.all_reduce_(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, D]
        pending, residual = None, self.embed(input_ids)
        for layer in self.layers:
            pending, residual = layer(positions, pending, residual)
        return self.norm(residual) if pending is None else self.norm.add(pending, residual)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [B, D] -> float32 logits [B, V] over the whole vocabulary on every rank
        # (written into `out` when given); split by vocabulary, each rank's rows gathered
        logits = self.tp.all_gather(F.linear(hidden, self.lm_head_weight), dim=-1)
        return logits.float() if out is None else out.copy_(logits)

    def adapter_linears(self) -> Iterator[tuple[int, AdapterLinear]]:
        for idx, layer in enumerate(self.layers):
            for module in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                yield idx, module

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.attn for layer in self.layers]
