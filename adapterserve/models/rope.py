"""Rotary position embeddings: default, linear and Llama-3 frequency scaling."""
from __future__ import annotations

import math

import torch

from adapterserve.layers.attention import PagedAttention


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies for the configured rope type."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE (rotate-half layout, as in Hugging Face Llama) to q and k."""

    def __init__(self, head_dim: int, params: dict, max_positions: int, device=None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_into_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn: PagedAttention, write_slots: torch.Tensor) -> None:
        """CUDA: rotate q in place and write rotated k and v to attn's KV cache, one launch."""
        from adapterserve.kernels.fused import rope_and_cache

        half = q.shape[-1] // 2
        rope_and_cache(q, k, v, positions, self.cos[:, :half], self.sin[:, :half], attn.k_cache, attn.v_cache,
                       write_slots, attn.k_scale, attn.v_scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)
