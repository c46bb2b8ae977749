"""read_peft_lora against PEFT itself: adapters made by peft, deltas computed by peft."""
from __future__ import annotations

import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapterserve.adapters_store.formats.peft_lora import read_peft_lora
from adapterserve.adapters_store.formats.types import DECODER_LINEARS
from adapterserve.errors import AdapterError
from adapterserve.models.tiny import ARCHS, write_tiny_checkpoint
from tests.helpers import (
    BAD_CASES,
    PICKLE_SENTINEL,
    backbone_spec,
    load_base,
    load_peft,
    make_bad_adapter,
    make_peft_lora,
    peft_deltas,
)

GOOD = {  # case -> (arch, make_peft_lora arguments)
    "r1_q": ("llama", dict(r=1, lora_alpha=2, target_modules=["q_proj"])),
    "r8_attn": ("mistral", dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    "r16_all": ("qwen2", dict(r=16, lora_alpha=32, target_modules=list(DECODER_LINEARS))),
    "r64_mlp": ("qwen3", dict(r=64, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"])),
    "rslora": ("llama", dict(r=4, lora_alpha=8, target_modules=["v_proj", "down_proj"], use_rslora=True)),
    "patterns": ("qwen3", dict(
        r=6, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 12},
        alpha_pattern={"v_proj": 3.0, r"model\.layers\.0\.mlp\.down_proj": 5},
    )),
    "regex_targets": ("mistral", dict(r=3, lora_alpha=7, target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj")),
    "layers_to_transform": ("qwen2", dict(
        r=5, lora_alpha=5, target_modules=["up_proj", "o_proj"], layers_to_transform=[1], layers_pattern="layers",
    )),
    "all_linear": ("llama", dict(r=2, lora_alpha=4, target_modules="all-linear")),
    "exclude_modules": ("llama", dict(
        r=4, lora_alpha=4, target_modules=["q_proj", "k_proj"], exclude_modules=["model.layers.0.self_attn.k_proj"],
    )),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=5) for arch in ARCHS}


@pytest.fixture(scope="module", params=sorted(GOOD))
def good(request, bases, tmp_path_factory):
    arch, kwargs = GOOD[request.param]
    adapter_dir = make_peft_lora(bases[arch], tmp_path_factory.mktemp(request.param), seed=1, **kwargs)
    spec = backbone_spec(bases[arch])
    return bases[arch], adapter_dir, spec, load_peft(bases[arch], adapter_dir)


def _our_deltas(adapter) -> dict[tuple[int, str], torch.Tensor]:
    return {addr: m.scaling * m.b @ m.a for addr, m in adapter.modules.items()}


def test_deltas_match_peft(good):
    base_dir, adapter_dir, spec, peft_model = good
    adapter = read_peft_lora(adapter_dir, spec, max_rank=64)
    theirs = peft_deltas(peft_model)
    ours = _our_deltas(adapter)
    assert sorted(ours) == sorted(theirs)
    for addr, delta in theirs.items():
        torch.testing.assert_close(ours[addr], delta, rtol=1e-5, atol=1e-6, msg=str(addr))
        assert adapter.modules[addr].a.dtype == torch.float32


def test_ranks_and_scalings_match_peft(good):
    _, adapter_dir, spec, peft_model = good
    adapter = read_peft_lora(adapter_dir, spec, max_rank=64)
    for name, module in peft_model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "r", {}):
            parts = name.split(".")
            ours = adapter.modules[(int(parts[parts.index("layers") + 1]), parts[-1])]
            assert ours.rank == module.r["default"]
            assert ours.scaling == pytest.approx(module.scaling["default"], rel=1e-12)


@torch.no_grad()
def test_base_plus_our_deltas_gives_peft_logits(good):
    base_dir, adapter_dir, spec, peft_model = good
    adapter = read_peft_lora(adapter_dir, spec, max_rank=64)
    patched = load_base(base_dir)
    ids = torch.randint(3, patched.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    base_logits = patched(ids).logits
    layers = patched.model.layers
    for (layer, kind), delta in _our_deltas(adapter).items():
        sub = layers[layer].self_attn if hasattr(layers[layer].self_attn, kind) else layers[layer].mlp
        getattr(sub, kind).weight += delta
    theirs = peft_model(ids).logits
    torch.testing.assert_close(patched(ids).logits, theirs, rtol=1e-4, atol=1e-4)
    assert (theirs - base_logits).abs().max() > 0.05  # the adapter visibly changes the output


@torch.no_grad()
def test_merged_weights_minus_base_equal_our_deltas(bases, tmp_path):
    arch, kwargs = GOOD["patterns"]
    adapter_dir = make_peft_lora(bases[arch], tmp_path / "a", seed=2, **kwargs)
    adapter = read_peft_lora(adapter_dir, backbone_spec(bases[arch]), max_rank=16)
    base = load_base(bases[arch]).state_dict()
    merged = load_peft(bases[arch], adapter_dir).merge_and_unload().state_dict()
    for (layer, kind), delta in _our_deltas(adapter).items():
        sub = "self_attn" if kind in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"model.layers.{layer}.{sub}.{kind}.weight"
        torch.testing.assert_close(merged[key] - base[key], delta, rtol=1e-4, atol=1e-6)


def _rewrite_keys(adapter_dir, rename, dtype=None):
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    tensors = {rename(k): v.to(dtype or v.dtype) for k, v in tensors.items()}
    save_file(tensors, adapter_dir / "adapter_model.safetensors")


@pytest.mark.parametrize("form", ["adapter_name", "no_prefix", "float16", "bfloat16"])
def test_other_saved_forms_read_the_same(bases, tmp_path, form):
    arch, kwargs = GOOD["r8_attn"]
    spec = backbone_spec(bases[arch])
    adapter_dir = make_peft_lora(bases[arch], tmp_path / "a", **kwargs)
    reference = _our_deltas(read_peft_lora(adapter_dir, spec, max_rank=8))
    if form == "adapter_name":
        _rewrite_keys(adapter_dir, lambda k: re.sub(r"\.lora_([AB])\.", r".lora_\1.default.", k))
    elif form == "no_prefix":
        _rewrite_keys(adapter_dir, lambda k: k.removeprefix("base_model.model."))
    else:
        _rewrite_keys(adapter_dir, lambda k: k, dtype=getattr(torch, form))
    ours = _our_deltas(read_peft_lora(adapter_dir, spec, max_rank=8))
    assert sorted(ours) == sorted(reference)
    tol = {"float16": 2e-3, "bfloat16": 2e-2}.get(form, 0.0)
    for addr in reference:
        torch.testing.assert_close(ours[addr], reference[addr], rtol=tol, atol=tol * reference[addr].abs().max())


# refusals

REFUSALS = {  # case -> fragments the message must contain
    "unknown_module_in_config": ["'foo_proj'", "do not have"],
    "unknown_module_in_weights": ["'foo_proj'", "do not have"],
    "layer_out_of_range": ["layers.2.", "2 layers"],
    "in_features_mismatch": ["layers.0.self_attn.o_proj", "in_features 96", "has 64"],
    "out_features_mismatch": ["layers.0.self_attn.q_proj", "out_features 69", "has 64"],
    "nan_weights": ["NaN", "layers.1.mlp.down_proj.lora_A"],
    "inf_weights": ["Inf", "layers.1.mlp.down_proj.lora_B"],
    "missing_lora_b": ["no lora_B", "layers.1.self_attn.q_proj"],
    "mismatched_ab_ranks": ["lora_A of rank 4", "lora_B of rank 7", "layers.0.self_attn.q_proj"],
    "unexpected_key": ["unexpected tensor", "model.norm.weight"],
    "pickle_only": ["adapter_model.bin", "pickle", "safetensors"],
    "no_weights": ["no adapter_model.safetensors"],
    "corrupt_weights": ["adapter_model.safetensors", "not a readable safetensors"],
    "no_config": ["no adapter_config.json"],
    "invalid_config": ["adapter_config.json", "not valid JSON"],
    "config_rank_mismatch": ["gives rank 5", "rank 4"],
    "untargeted_weights": ["down_proj", "does not target"],
    "targets_without_weights": ["layers.0.self_attn.v_proj", "no lora_A/lora_B"],
    "fan_in_fan_out": ["fan_in_fan_out"],
    "invalid_regex": ["not a valid regex"],
    "wrong_option_type": ["rank_pattern=", "not a valid value"],
    "prefix_tuning": ["peft_type PREFIX_TUNING is not supported yet"],
    "ia3": ["peft_type IA3 is not supported yet"],
    "dora": ["DoRA", "not supported yet"],
    "bias_all": ["bias='all'"],
    "lora_bias": ["lora_bias", "not supported yet"],
    "embedding_lora": ["embed_tokens", "not supported yet"],
    "lm_head_lora": ["lm_head", "not supported yet"],
    "modules_to_save": ["modules_to_save", "lm_head", "classification head"],
    "pissa_unconverted": ["init_lora_weights='pissa'", "path_initial_model_for_weight_conversion"],
}


@pytest.fixture(scope="module")
def refusal_base(bases, tmp_path_factory):
    base = bases["llama"]
    good_dir = make_peft_lora(base, tmp_path_factory.mktemp("good"), r=4, lora_alpha=8,
                              target_modules=["q_proj", "down_proj"])
    return base, good_dir, backbone_spec(base)


def test_every_bad_case_has_expectations():
    assert set(REFUSALS) == set(BAD_CASES)


def test_good_adapter_of_refusal_cases_is_accepted(refusal_base):
    base, good_dir, spec = refusal_base
    assert read_peft_lora(good_dir, spec, max_rank=4).rank == 4


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_adapter_is_refused(case, refusal_base, tmp_path):
    base, good_dir, spec = refusal_base
    bad = make_bad_adapter(case, base, good_dir, tmp_path / case)
    with pytest.raises(AdapterError) as info:
        read_peft_lora(bad, spec, max_rank=64, name="my-adapter")
    message = str(info.value)
    assert "my-adapter" in message
    for fragment in REFUSALS[case]:
        assert fragment in message, (case, message)


def test_pickle_is_never_opened(refusal_base, tmp_path, monkeypatch):
    base, good_dir, spec = refusal_base
    bad = make_bad_adapter("pickle_only", base, good_dir, tmp_path / "bad")

    def forbidden(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    for module, attr in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, attr, forbidden)
    with pytest.raises(AdapterError):
        read_peft_lora(bad, spec, max_rank=64)
    assert not (bad / PICKLE_SENTINEL).exists()


def test_trap_pickle_would_fire(refusal_base, tmp_path):
    """The pickle test above can fail: unpickling the trap does create the sentinel."""
    base, good_dir, spec = refusal_base
    bad = make_bad_adapter("pickle_only", base, good_dir, tmp_path / "bad")
    pickle.loads((bad / "adapter_model.bin").read_bytes())
    assert (bad / PICKLE_SENTINEL).exists()


def test_rank_above_max_is_refused(bases, tmp_path):
    arch, kwargs = GOOD["patterns"]  # ranks 2, 6 and 12 (layers.1 down_proj)
    adapter_dir = make_peft_lora(bases[arch], tmp_path / "a", **kwargs)
    spec = backbone_spec(bases[arch])
    assert read_peft_lora(adapter_dir, spec, max_rank=12).rank == 12
    with pytest.raises(AdapterError, match=r"rank 12 at layers\.1\.mlp\.down_proj.*maximum rank 8"):
        read_peft_lora(adapter_dir, spec, max_rank=8)


def test_not_a_directory_is_refused(tmp_path, refusal_base):
    _, _, spec = refusal_base
    with pytest.raises(AdapterError, match="not a directory"):
        read_peft_lora(tmp_path / "nowhere", spec, max_rank=8)
