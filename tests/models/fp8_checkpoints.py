"""FP8 checkpoints written here with torch + safetensors from a float one, in the layouts
llm-compressor (compressed-tensors), transformers' fbgemm_fp8 and fp8 configs write; and
the float checkpoint whose weights are those FP8 weights dequantized (the oracle)."""
from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
E4M3_MAX = 448.0
# the random Llama the FP8 GPU tests share: widths a GPU kernel tiles as it would a real model's
GPU_MODEL = dict(num_layers=4, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=2048, seed=3)

QUANT_CONFIGS = {
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }},
        "ignore": ["lm_head"],
    },
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]},
}


def channel_quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scale [N, 1]) with scale = row absmax / 448."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def tensor_quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().max() / E4M3_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale.reshape(1)


def block_quantized(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scale[i, j] = tile.abs().max() / E4M3_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _copy_dir(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    for f in list(dst.glob("model*.safetensors*")):
        f.unlink()


def _float_tensors(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("model*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def write_fp8_checkpoint(src: Path, dst: Path, layout: str = "compressed-tensors",
                         edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """The float checkpoint at src with every decoder linear weight stored in FP8 (layout: a
    QUANT_CONFIGS key); edit may spoil the tensors before they are written."""
    _copy_dir(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _float_tensors(src).items():
        if not LINEAR.search(name):
            out[name] = t
            continue
        if layout == "fp8-block":
            out[name], out[name + "_scale_inv"] = block_quantized(t, 16, 32)
            continue
        q, scale = tensor_quantized(t) if layout == "fp8-tensor" else channel_quantized(t)
        out[name], out[name + "_scale"] = q, scale
        if layout == "fp8-tensor":
            out[name.replace(".weight", ".input_scale")] = torch.tensor([0.02])
    if edit is not None:
        edit(out)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = QUANT_CONFIGS[layout]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def write_dequantized_checkpoint(fp8_dir: Path, dst: Path) -> Path:
    """A float32 checkpoint holding what the FP8 one at fp8_dir means (weight times scale)."""
    _copy_dir(fp8_dir, dst)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    block = cfg.pop("quantization_config").get("weight_block_size")
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t
        elif name + "_scale" in tensors:
            scale = tensors[name + "_scale"].float()
            out[name] = t.float() * (scale if scale.dim() == 2 else scale.reshape(1, 1))
        else:
            s = tensors[name + "_scale_inv"].float()
            full = s.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]
            out[name] = t.float() * full
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
