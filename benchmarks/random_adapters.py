"""Random adapters of every family, in memory and as PEFT files, for the benchmark.

Thousands of adapters share a small bank of random host tensors (the engine copies
each adapter into its own slot, so sharing host memory changes nothing it reads);
each adapter gets its own LoRA scaling. One PEFT LoRA directory is written by
peft itself from a meta-device model, so the file path is exercised for any size.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.families import Adapter, Ia3Adapter, PrefixAdapter, PromptAdapter
from adapterserve.adapters_store.formats.types import BottleneckAdapter, BottleneckModule, LoraAdapter, LoraModule
from benchmarks.checkpoints import LINEARS, ModelShape

IA3_TARGETS = ("k_proj", "v_proj", "down_proj")  # PEFT's default for Llama; down_proj scales its input
VIRTUAL_TOKENS = 16  # prompt-tuning and prefix-tuning length
BOTTLENECK_RANK = 16
SCALING = 2  # write_peft_lora's lora_alpha / rank


class AdapterFactory:
    """Adapters for one backbone shape; tensors are float32 on the host."""

    def __init__(self, shape: ModelShape, device: str, variants: int = 2, seed: int = 0) -> None:
        self.shape = shape
        self.device = device
        self.variants = variants
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self._lora_banks: dict[int, list[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]] = {}

    def _randn(self, *dims: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(dims, generator=self.gen, device=self.device) * std).cpu()

    def _lora_bank(self, rank: int) -> list[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]:
        if rank not in self._lora_banks:
            shapes = self.shape.linear_shapes()
            self._lora_banks[rank] = [
                {(layer, kind): (self._randn(rank, fan_in, std=fan_in ** -0.5), self._randn(fan_out, rank, std=0.01))
                 for layer in range(self.shape.layers) for kind, (fan_in, fan_out) in shapes.items()}
                for _ in range(self.variants)
            ]
        return self._lora_banks[rank]

    def lora(self, index: int, rank: int = 16, targets: tuple[str, ...] | None = None) -> Adapter:
        """Rank ``rank`` LoRA on every layer's ``targets`` (None: all seven projections)."""
        bank = self._lora_bank(rank)[index % self.variants]
        scaling = 1.0 + (index % 13) / 13
        modules = {key: LoraModule(a, b, scaling) for key, (a, b) in bank.items() if targets is None or key[1] in targets}
        return Adapter("lora", lora=LoraAdapter(modules, {"r": rank}))

    def ia3(self, index: int) -> Adapter:
        shapes = self.shape.linear_shapes()
        scales = {(layer, kind): 1.0 + self._randn(shapes[kind][0 if kind == "down_proj" else 1], std=0.1)
                  for layer in range(self.shape.layers) for kind in IA3_TARGETS}
        return Adapter("ia3", ia3=Ia3Adapter(scales, frozenset({"down_proj"})))

    def prompt(self, index: int) -> Adapter:
        return Adapter("prompt_tuning", prompt=PromptAdapter(self._randn(VIRTUAL_TOKENS, self.shape.hidden, std=0.02)))

    def prefix(self, index: int) -> Adapter:
        s = self.shape
        dims = (s.layers, VIRTUAL_TOKENS, s.kv_heads, s.head_dim)
        return Adapter("prefix_tuning", prefix=PrefixAdapter(self._randn(*dims), self._randn(*dims)))

    def bottleneck(self, index: int, rank: int = BOTTLENECK_RANK) -> Adapter:
        """Houlsby bottlenecks after attention ("mh") and after the FFN ("output")."""
        d = self.shape.hidden
        modules = {
            (layer, pos): BottleneckModule(self._randn(rank, d, std=d ** -0.5), self._randn(rank, std=0.1),
                                           self._randn(rank, d, std=0.01), self._randn(d, std=0.01), "relu")
            for layer in range(self.shape.layers) for pos in ("mh", "output")
        }
        return Adapter("bottleneck", bottleneck=BottleneckAdapter(modules, original_ln_before=False))

    def family(self, family: str, index: int) -> Adapter:
        return getattr(self, family)(index)


def decode_read_bytes(adapter: Adapter, element_size: int) -> int:
    """Bytes of an adapter's weights a decode step must read once (prompt and prefix:
    none; a prefix's keys and values are counted with the KV cache)."""
    n = 0
    if adapter.lora is not None:
        n += sum(m.rank * (m.a.shape[1] + m.b.shape[0]) for m in adapter.lora.modules.values())
    if adapter.ia3 is not None:
        n += sum(v.numel() for v in adapter.ia3.scales.values())
    if adapter.bottleneck is not None:
        n += sum(2 * m.down.numel() + m.down_bias.numel() + m.up_bias.numel()
                 for m in adapter.bottleneck.modules.values())
    return n * element_size


def write_peft_lora(shape: ModelShape, out: Path, device: str, rank: int = 16, seed: int = 1,
                    gain: float = 2.0) -> Path:
    """A PEFT LoRA directory (rank ``rank``, all seven projections) saved by peft itself. A's and B's
    entries are drawn with variance 1 / fan-in, B then scaled so that each update's expected norm is
    ``gain`` times the random checkpoint's base output's (write_random_checkpoint: weights of
    variance 1 / fan-in too); the default 2.0 leaves B unscaled (lora_alpha / rank is 2).

    The base model is built on the meta device, so no backbone weights exist; only
    the LoRA weights are materialised, drawn on ``device``.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        base = LlamaForCausalLM(shape.hf_config())
    config = LoraConfig(r=rank, lora_alpha=SCALING * rank, target_modules=list(LINEARS), task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            for part in (module.lora_A["default"], module.lora_B["default"]):
                fan_in = part.weight.shape[1]
                data = torch.randn(part.weight.shape, generator=gen, device=device) / math.sqrt(fan_in)
                if part is module.lora_B["default"]:
                    data = data * (gain / SCALING)
                part.weight = torch.nn.Parameter(data.cpu(), requires_grad=False)
    model.save_pretrained(str(out))
    return out
