"""Load Hugging Face safetensors checkpoints (single file or sharded, float or FP8) into our models."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from adapterserve.layers.linear import AdapterLinear
from adapterserve.layers.parallel import SINGLE, TensorParallel
from adapterserve.models import fp8
from adapterserve.models.decoder import DecoderModel
from adapterserve.models.decoder_config import DecoderConfig, read_decoder_config

_PREFIXES = ("model.", "")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint; pickled weights are never read."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(f"{model_dir} holds only pickled weights (*.bin/*.pt); convert them to safetensors")
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class CheckpointTensors:
    """Random access to a checkpoint's tensors by name, over all its shards; reads whole
    tensors or one contiguous part along a dimension (only those bytes leave the file).
    ``bytes_read`` counts the bytes of every tensor returned."""

    def __init__(self, model_dir: Path) -> None:
        self._files = [safe_open(str(path), framework="pt") for path in checkpoint_files(model_dir)]
        self._where = {name: f for f in self._files for name in f.keys()}
        self.bytes_read = 0

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor | None:
        f = self._where.get(name)
        return None if f is None else self._counted(f.get_tensor(name))

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Items start .. start + length of the tensor along dim (0 or 1)."""
        part = self._where[name].get_slice(name)
        index = (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
        return self._counted(part[index])

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


class Part(NamedTuple):
    """The items start .. start + length of a checkpoint tensor along dim, whose full size
    there is whole: a tensor-parallel rank's shard."""

    dim: int
    start: int
    length: int
    whole: int


class _Target(NamedTuple):
    dest: torch.Tensor | None  # None: the checkpoint tensor is not needed (a tied lm_head)
    offset: int  # first row inside a fused weight
    scale: torch.Tensor | None  # the FP8 weight's per-channel scale, rows aligned with dest
    part: Part | None = None  # this tensor-parallel rank's part of the checkpoint tensor (None: all of it)


def _target(model: DecoderModel, name: str) -> _Target | None:
    """Our tensor for an HF weight name, the row offset inside a fused weight, and the part
    a tensor-parallel rank reads."""
    cfg = model.cfg
    vocab = (Part(0, model.vocab_start, model.embed_tokens.num_embeddings, cfg.vocab_size)
             if model.tp.world_size > 1 else None)
    if name == "lm_head.weight":
        return _Target(None if cfg.tie_word_embeddings else model.lm_head_weight, 0, None, vocab)
    for prefix in _PREFIXES:
        if name.startswith(prefix + "layers.") or name in (prefix + "embed_tokens.weight", prefix + "norm.weight"):
            name = name[len(prefix):]
            break
    if name == "embed_tokens.weight":
        return _Target(model.embed_tokens.weight, 0, None, vocab)
    if name == "norm.weight":
        return _Target(model.norm.weight, 0, None)
    parts = name.split(".")
    if parts[0] != "layers":
        return None
    layer = model.layers[int(parts[1])]
    module, param = ".".join(parts[2:-1]), parts[-1]
    fused = {
        "self_attn.q_proj": (layer.qkv_proj, 0),
        "self_attn.k_proj": (layer.qkv_proj, 1),
        "self_attn.v_proj": (layer.qkv_proj, 2),
        "self_attn.o_proj": (layer.o_proj, 0),
        "mlp.gate_proj": (layer.gate_up_proj, 0),
        "mlp.up_proj": (layer.gate_up_proj, 1),
        "mlp.down_proj": (layer.down_proj, 0),
    }
    if module in fused:
        linear, index = fused[module]
        offset = sum(linear.slice_widths[:index])  # this rank's widths: each slice split on its own
        scale = linear.weight_scale if param == "weight" else None
        return _Target(getattr(linear, param), offset, scale, _linear_part(linear, index, param))
    plain = {
        "input_layernorm": layer.input_layernorm,
        "post_attention_layernorm": layer.post_attention_layernorm,
        "self_attn.q_norm": getattr(layer, "q_norm", None),
        "self_attn.k_norm": getattr(layer, "k_norm", None),
    }
    target = plain.get(module)
    return _Target(target.weight, 0, None) if target is not None else None


def _linear_part(linear: AdapterLinear, index: int, param: str) -> Part | None:
    """Column-parallel: the slice's output rows (weight and bias); row-parallel: the weight's
    input columns, the bias whole (added once, after the all-reduce)."""
    if linear.parallel == "column":
        return Part(0, *linear.spans.outputs[index], linear.full_slice_widths[index])
    if linear.parallel == "row" and param == "weight":
        return Part(1, *linear.spans.input, linear.full_in_features)
    return None


def _read(ckpt: CheckpointTensors, name: str, part: Part | None) -> tuple[torch.Tensor, tuple[int, int]]:
    """This rank's part of a checkpoint tensor and where it starts in the whole (row, column)."""
    if part is None:
        return ckpt.get(name), (0, 0)
    shape = ckpt.shape(name)
    if len(shape) <= part.dim or shape[part.dim] != part.whole:
        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, expected {part.whole} along dim {part.dim}")
    origin = (part.start, 0) if part.dim == 0 else (0, part.start)
    return ckpt.get_part(name, part.dim, part.start, part.length), origin


def load_weights(model: DecoderModel, model_dir: Path) -> int:
    """Copy every checkpoint tensor into the model; error on missing or unknown ones.
    FP8 checkpoints load into FP8 weights as stored and are dequantized elsewhere; float
    weights are quantized per channel where the model holds FP8 ones. A tensor-parallel
    model reads only its rank's part of each split tensor (FP8 scales whole: they are small).
    Returns the bytes read."""
    block = fp8.read_block_size(model_dir)
    ckpt = CheckpointTensors(model_dir)
    loaded: dict[int, int] = {}  # id(param) -> rows written
    scales_used: set[str] = set()
    for name in ckpt.names():
        if fp8.is_scale_name(name) or fp8.is_ignored_name(name) or name.endswith("rotary_emb.inv_freq"):
            continue
        target = _target(model, name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in a {model.cfg.model_type} decoder")
        if target.dest is None:
            continue
        tensor, origin = _read(ckpt, name, target.part)
        values, scale, scale_name = fp8.read_weight(name, tensor, ckpt.get, block, ckpt.shape(name), origin)
        scales_used.add(scale_name)
        for param in _write(name, target, values, scale, model.tp):
            loaded[id(param)] = loaded.get(id(param), 0) + values.shape[0]
    orphans = [n for n in ckpt.names() if fp8.is_scale_name(n) and n not in scales_used]
    if orphans:
        raise ValueError(f"checkpoint tensor {orphans[0]!r} is a scale without a float8_e4m3fn weight beside it")
    missing = [n for n, p in model.named_parameters() if loaded.get(id(p), 0) != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights (or has duplicates) for: {', '.join(missing[:8])}")
    return ckpt.bytes_read


def _write(name: str, target: _Target, values: torch.Tensor, scale: torch.Tensor | None,
           tp: TensorParallel = SINGLE) -> list[torch.Tensor]:
    """Copy one checkpoint tensor into its rows (quantizing or dequantizing as the
    destination needs); the parameters written."""
    rows = target.dest[target.offset : target.offset + values.shape[0]]
    if rows.shape != values.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(values.shape)}, expected {tuple(rows.shape)}")
    if rows.dtype != fp8.FP8:
        rows.copy_(values if scale is None else fp8.dequantize(values, scale))
        return [target.dest]
    if scale is None:
        values = values.to(rows.device)
        values, scale = fp8.quantize_per_channel(values, _row_absmax(values, target.part, tp))
    rows.copy_(values)
    target.scale[target.offset : target.offset + values.shape[0]].copy_(scale)
    return [target.dest, target.scale]


def _row_absmax(values: torch.Tensor, part: Part | None, tp: TensorParallel) -> torch.Tensor | None:
    """Each row's absmax over all ranks when this rank holds only some of its columns (one
    all-reduce, every rank loading the same tensor); None otherwise (the part's own)."""
    if part is None or part.dim != 1:
        return None
    return tp.all_reduce_(values.float().abs().amax(dim=1), op="max")


def load_decoder(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, max_positions: int | None = None,
    fp8_gemm: str | None = None, tp: TensorParallel = SINGLE,
) -> tuple[DecoderModel, DecoderConfig]:
    """fp8_gemm: None for linear weights in dtype; else FP8 weights run by that kernel
    (layers.base_gemm), quantized at load unless the checkpoint holds FP8 ones.
    tp: this rank's place in a tensor-parallel group; it reads and holds only its shards."""
    model_dir = Path(model_dir)
    cfg = read_decoder_config(model_dir)
    model = DecoderModel(cfg, max_positions or cfg.max_position_embeddings, dtype, device, fp8=fp8_gemm is not None,
                         tp=tp)
    with torch.no_grad():
        load_weights(model, model_dir)
    for _, linear in model.adapter_linears():
        linear.fp8_gemm = fp8_gemm or "auto"
    if fp8_gemm is not None and torch.device(device).type == "cuda":
        from adapterserve.kernels.fp8_w8a8 import prepare_w8a8

        prepare_w8a8(device)  # before any CUDA-graph capture
    return model.eval(), cfg
