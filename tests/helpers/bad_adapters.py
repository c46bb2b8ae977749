"""Adapter directories that must be refused, one per way an adapter can be unfit.

Each maker takes (base_model_dir, good_dir, out_dir) and returns the bad directory:
either an edited copy of ``good_dir`` (a plain PEFT LoRA adapter of rank >= 2 made
by ``make_peft_lora`` on ``base_model_dir``, targeting q_proj and down_proj among
others) or an adapter that peft itself made with an unsupported option.
"""
from __future__ import annotations

import json
import pathlib
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from peft import IA3Config, LoraConfig, PrefixTuningConfig, get_peft_model
from safetensors.torch import load_file, save_file

from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.lora import load_base, make_peft_lora

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PICKLE_SENTINEL = "UNPICKLED"  # created next to adapter_model.bin if anything unpickles it

Maker = Callable[[Path, Path, Path], Path]


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(adapter_dir: Path, edit: Callable[[dict], None]) -> Path:
    config = json.loads((adapter_dir / CONFIG).read_text())
    edit(config)
    (adapter_dir / CONFIG).write_text(json.dumps(config))
    return adapter_dir


def edit_weights(adapter_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_file(adapter_dir / WEIGHTS)
    edit(tensors)
    save_file(tensors, adapter_dir / WEIGHTS, metadata={"format": "pt"})
    return adapter_dir


def key_of(tensors: dict[str, torch.Tensor], *parts: str) -> str:
    """First key containing every part, e.g. key_of(t, "layers.0.", "q_proj", "lora_A")."""
    return next(k for k in sorted(tensors) if all(p in k for p in parts))


def _config_case(edit: Callable[[dict], None]) -> Maker:
    return lambda base, good, out: edit_config(copy_adapter(good, out), edit)


def _weights_case(edit: Callable[[dict[str, torch.Tensor]], None]) -> Maker:
    return lambda base, good, out: edit_weights(copy_adapter(good, out), edit)


def _peft_made(config_factory: Callable[[], object]) -> Maker:
    def make(base: Path, good: Path, out: Path) -> Path:
        get_peft_model(load_base(base), config_factory()).save_pretrained(out)
        return out

    return make


def _other_backbone(targets: list[str], **tiny_kwargs) -> Maker:
    """A valid adapter, made by peft for a different tiny backbone of the same arch."""
    def make(base: Path, good: Path, out: Path) -> Path:
        arch = json.loads((base / "config.json").read_text())["model_type"]
        other = write_tiny_checkpoint(out.parent / f"{out.name}-base", arch, **tiny_kwargs)
        return make_peft_lora(other, out, r=4, lora_alpha=8, target_modules=targets)

    return make


def _pickle_only(base: Path, good: Path, out: Path) -> Path:
    out.mkdir()
    shutil.copy(good / CONFIG, out / CONFIG)
    (out / "adapter_model.bin").write_bytes(pickle.dumps(_Trap(out / PICKLE_SENTINEL)))
    return out


class _Trap:
    """Unpickling this creates the sentinel file: proof that something unpickled it."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (pathlib.Path.touch, (self.sentinel,))


def _unknown_module_in_weights(tensors: dict[str, torch.Tensor]) -> None:
    for key in [k for k in tensors if ".layers.0.self_attn.q_proj." in k]:
        tensors[key.replace("q_proj", "foo_proj")] = tensors.pop(key)


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda config: config.__setitem__(key, value)


def _add_target(kind: str) -> Callable[[dict], None]:
    return lambda config: config.__setitem__("target_modules", [*config["target_modules"], kind])


def _drop_target(kind: str) -> Callable[[dict], None]:
    return lambda config: config.__setitem__("target_modules", [t for t in config["target_modules"] if t != kind])


def _missing_targets(base: Path, good: Path, out: Path) -> Path:
    targets = json.loads((good / CONFIG).read_text())["target_modules"]
    absent = next(k for k in ("v_proj", "k_proj", "up_proj", "gate_proj", "o_proj") if k not in targets)
    return edit_config(copy_adapter(good, out), _add_target(absent))


def _poison(part: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key_of(tensors, "layers.1.", "down_proj", part)][0, 0] = value

    return edit


def _resize(part: str, dim: int, extra: int) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        key = key_of(tensors, "layers.0.", "q_proj", part)
        grow = list(tensors[key].shape)
        grow[dim] = extra
        tensors[key] = torch.cat([tensors[key], torch.randn(grow)], dim=dim)

    return edit


def _unlink(name: str) -> Maker:
    def make(base: Path, good: Path, out: Path) -> Path:
        (copy_adapter(good, out) / name).unlink()
        return out

    return make


def _write(name: str, data: bytes) -> Maker:
    def make(base: Path, good: Path, out: Path) -> Path:
        (copy_adapter(good, out) / name).write_bytes(data)
        return out

    return make


BAD_CASES: dict[str, Maker] = {
    # module names and shapes the backbone lacks
    "unknown_module_in_config": _config_case(_add_target("foo_proj")),
    "unknown_module_in_weights": lambda base, good, out: edit_config(
        edit_weights(copy_adapter(good, out), _unknown_module_in_weights), _add_target("foo_proj")
    ),
    "layer_out_of_range": _other_backbone(["q_proj", "down_proj"], num_layers=4),
    "in_features_mismatch": _other_backbone(["o_proj"], hidden_size=96),
    "out_features_mismatch": _weights_case(_resize("lora_B", 0, 5)),
    # weights
    "nan_weights": _weights_case(_poison("lora_A", float("nan"))),
    "inf_weights": _weights_case(_poison("lora_B", float("inf"))),
    "missing_lora_b": _weights_case(lambda t: t.pop(key_of(t, "layers.1.", "q_proj", "lora_B"))),
    "mismatched_ab_ranks": _weights_case(_resize("lora_B", 1, 3)),
    "unexpected_key": _weights_case(lambda t: t.__setitem__("base_model.model.model.norm.weight", torch.ones(8))),
    "pickle_only": _pickle_only,
    "no_weights": _unlink(WEIGHTS),
    "corrupt_weights": _write(WEIGHTS, b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}"),
    # config
    "no_config": _unlink(CONFIG),
    "invalid_config": _write(CONFIG, b"{\"peft_type\": \"LORA\", "),
    "config_rank_mismatch": _config_case(lambda c: c.__setitem__("r", c["r"] + 1)),
    "untargeted_weights": _config_case(_drop_target("down_proj")),
    "targets_without_weights": _missing_targets,
    "fan_in_fan_out": _config_case(_set("fan_in_fan_out", True)),
    "invalid_regex": _config_case(_set("rank_pattern", {"q_proj(": 2})),
    "wrong_option_type": _config_case(_set("rank_pattern", [["q_proj", 2]])),
    # made by peft with what is not supported
    "prefix_tuning": _peft_made(lambda: PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM")),
    "ia3": _peft_made(lambda: IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])),
    "dora": _peft_made(lambda: LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)),
    "bias_all": _peft_made(lambda: LoraConfig(r=4, target_modules=["q_proj"], bias="all")),
    "lora_bias": _peft_made(lambda: LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True)),
    "embedding_lora": _peft_made(lambda: LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])),
    "lm_head_lora": _peft_made(lambda: LoraConfig(r=4, target_modules=["q_proj", "lm_head"])),
    "pissa_unconverted": _peft_made(lambda: LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa")),
    "modules_to_save": _peft_made(lambda: LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])),
}


def make_bad_adapter(case: str, base_model_dir: Path, good_dir: Path, out_dir: Path) -> Path:
    """Write the bad adapter ``case`` (a key of BAD_CASES) to ``out_dir``."""
    return BAD_CASES[case](Path(base_model_dir), Path(good_dir), Path(out_dir))
