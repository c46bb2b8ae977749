"""Random-weight Llama-shaped checkpoints, written fast on the benchmark's device.

Tensors are drawn on the device in bfloat16, copied to the host one shard at a
time and saved with safetensors (sharded, with an index), next to a config.json
written by transformers' LlamaConfig. No transformers model is ever built, so an
8B checkpoint costs ~16 GB of host memory for one shard at most, never float32.
"""
from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """kind -> (in_features, out_features)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.inter
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face weight names -> shapes, in checkpoint order."""
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        for layer in range(self.layers):
            base = f"model.layers.{layer}"
            shapes[f"{base}.input_layernorm.weight"] = (self.hidden,)
            for kind, (fan_in, fan_out) in self.linear_shapes().items():
                group = "mlp" if kind in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                shapes[f"{base}.{group}.{kind}.weight"] = (fan_out, fan_in)
            shapes[f"{base}.post_attention_layernorm.weight"] = (self.hidden,)
        shapes["model.norm.weight"] = (self.hidden,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab, self.hidden)
        return shapes

    def checkpoint_bytes(self) -> int:
        return 2 * sum(math.prod(s) for s in self.tensor_shapes().values())

    def hf_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, intermediate_size=self.inter, vocab_size=self.vocab,
            head_dim=self.head_dim, tie_word_embeddings=self.tied, max_position_embeddings=131072,
            rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=2,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        )


SHAPES = {
    "1b": ModelShape("1b", 2048, 16, 32, 8, 8192, 128256, tied=True),
    "8b": ModelShape("8b", 4096, 32, 32, 8, 14336, 128256, tied=False),
    "tiny": ModelShape("tiny", 64, 2, 4, 2, 160, 512, tied=True),  # --smoke
}


def scratch_dir(need_bytes: int) -> Path:
    """A fresh directory in /dev/shm when it has room (no disk writes), else in /tmp; removed
    when this process exits (a checkpoint left in /dev/shm holds memory until reboot)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 1.25 * need_bytes else None
    path = Path(tempfile.mkdtemp(prefix="adapterserve-bench-", dir=base))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def write_random_checkpoint(shape: ModelShape, out: Path, device: str, shard_bytes: int = 4 << 30,
                            seed: int = 0) -> Path:
    """Write ``shape`` as a bfloat16 safetensors checkpoint with random weights to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    shapes = shape.tensor_shapes()
    groups = _shard_groups(shapes, shard_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _random_tensor(name, shapes[name], gen, device) for name in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": shape.checkpoint_bytes()}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    shape.hf_config().save_pretrained(out)
    return out


def _shard_groups(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, dims in shapes.items():
        nbytes = 2 * math.prod(dims)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _random_tensor(name: str, dims: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """Norms at 1, matrices N(0, 1/fan_in); drawn on the device, returned on the host."""
    if len(dims) == 1:
        return torch.ones(dims, dtype=torch.bfloat16)
    std = 1.0 / math.sqrt(dims[1])
    return (torch.randn(dims, generator=gen, device=device, dtype=torch.bfloat16) * std).cpu()
