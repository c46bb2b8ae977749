"""FP8 weights: per-channel quantization at load, and FP8 checkpoints as written by
compressed-tensors (llm-compressor), transformers' fbgemm_fp8 and fp8 (AutoFP8 and
fine-grained block) configs.

On disk a quantized linear is ``<module>.weight`` in float8_e4m3fn with either
``<module>.weight_scale`` (float32: one per tensor, shape [] or [1]; or one per output
channel, [N] or [N, 1]) or ``<module>.weight_scale_inv`` (one per [bn, bk] block,
[ceil(N/bn), ceil(K/bk)], block size from config.json's ``weight_block_size``). The
real weight is ``float(weight) * scale``. Static activation scales (``input_scale``)
and KV-cache scales are ignored: activations are quantized per token, the KV cache
stays in the activations' dtype.

A tensor-parallel rank reads a part of each weight (``origin``: where it starts in the
whole); its scales are the part's rows of the stored per-channel scales, or its blocks'
scales. Quantizing at load, a row-parallel layer's ranks agree on each row's absmax (one
all-reduce), so every rank holds exactly its columns of the TP=1 weights and scales.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12
_FLOAT8 = {FP8, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
IGNORED_SUFFIXES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale")
QUANT_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")


def quantize_per_channel(weight: torch.Tensor, absmax: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] -> (q [N, K] float8_e4m3fn, scale [N] float32), scale = row absmax / 448.
    absmax: [N] float32, each row's absmax when weight holds only part of its rows' columns."""
    w = weight.float()
    absmax = w.abs().amax(dim=1) if absmax is None else absmax
    scale = (absmax / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q: [N, K] float8, scale: [N] -> float32 [N, K]."""
    return q.float() * scale.float()[:, None]


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def is_ignored_name(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES)


def read_block_size(model_dir: Path) -> tuple[int, int] | None:
    """Check config.json's quantization_config (if any) is an FP8 one we load; the block
    size of block-wise scales, or None. ValueError naming the field otherwise."""
    qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"{model_dir}/config.json: quantization_config.quant_method {method!r} is not supported; "
            f"FP8 checkpoints ({', '.join(QUANT_METHODS)}) or unquantized ones load"
        )
    if method == "compressed-tensors":
        _check_compressed_tensors(model_dir, qc)
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{model_dir}/config.json: quantization_config.weight_block_size must be [rows, cols], "
                         f"got {block!r}")
    return block[0], block[1]


def _check_compressed_tensors(model_dir: Path, qc: dict) -> None:
    for group, spec in (qc.get("config_groups") or {}).items():
        weights = spec.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"{model_dir}/config.json: quantization_config.config_groups.{group}.weights is "
                f"{weights.get('type')!r} with {weights.get('num_bits')!r} bits; only 8-bit float weights load"
            )


def read_weight(
    name: str, tensor: torch.Tensor, get: Callable[[str], torch.Tensor | None], block: tuple[int, int] | None,
    full_shape: tuple[int, ...] | None = None, origin: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor | None, str | None]:
    """A checkpoint tensor (or the part of it at ``origin`` in a tensor of ``full_shape``) as
    (values, per-channel scale or None, scale tensor's name or None). Float8 weights come with
    their float32 scale for the part's rows; block-scaled ones are dequantized to float32 (no
    scale). Anything else passes through."""
    if tensor.dtype not in _FLOAT8:
        return tensor, None, None
    if tensor.dtype != FP8:
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; FP8 weights must be float8_e4m3fn")
    if not name.endswith(".weight") or tensor.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is float8 with shape {tuple(tensor.shape)}; "
                         "only 2-D linear weights may be float8")
    full_shape = tuple(tensor.shape) if full_shape is None else tuple(full_shape)
    scale = get(name + "_scale")
    if scale is not None:
        rows = channel_scale(name + "_scale", scale, full_shape[0])
        return tensor, rows[origin[0] : origin[0] + tensor.shape[0]].contiguous(), name + "_scale"
    scale_inv = get(name + "_scale_inv")
    if scale_inv is not None:
        values = dequantize_blocks(name + "_scale_inv", tensor, scale_inv, block, full_shape, origin)
        return values, None, name + "_scale_inv"
    raise ValueError(f"checkpoint tensor {name!r} is float8_e4m3fn but has no {name + '_scale'!r} "
                     f"(or {name + '_scale_inv'!r}): its scale is missing")


def channel_scale(name: str, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored per-tensor or per-channel scale as float32 [rows]; ValueError when its
    shape fits neither or a value is not finite and positive."""
    if tuple(scale.shape) not in ((), (1,), (1, 1), (rows,), (rows, 1)):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(scale.shape)}; a scale must be per tensor "
                         f"([] or [1]) or per output channel ([{rows}] or [{rows}, 1])")
    values = scale.float().reshape(-1).expand(rows) if scale.numel() == 1 else scale.float().reshape(rows)
    _check_finite_positive(name, values)
    return values.contiguous()


def dequantize_blocks(name: str, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                      full_shape: tuple[int, ...] | None = None, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """q: [n, k] float8, the part at ``origin`` of a [N, K] weight with one scale per [bn, bk]
    block -> float32 [n, k]."""
    if block is None:
        raise ValueError(f"checkpoint tensor {name!r} holds block scales but config.json's quantization_config "
                         "has no weight_block_size")
    (n, k), (bn, bk) = full_shape or q.shape, block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(scale_inv.shape)}; blocks of {bn}x{bk} over "
                         f"a [{n}, {k}] weight need {list(want)}")
    _check_finite_positive(name, scale_inv.float())
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    (row, col), (rows, cols) = origin, q.shape
    return q.float() * full[row : row + rows, col : col + cols]


def _check_finite_positive(name: str, values: torch.Tensor) -> None:
    flat = values.reshape(-1)
    bad = ~(torch.isfinite(flat) & (flat > 0))
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(f"checkpoint tensor {name!r} has a scale that is not a finite positive number "
                         f"({flat[first].item()} at flat index {first})")
