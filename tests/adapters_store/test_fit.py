"""One validation path: what an upload is checked with (adapters_store/fit.py, from the
engine's reported facts) refuses exactly what the engine refuses on load, with the same
message, for every family; host copies are kept in the serving dtype."""
from __future__ import annotations

import json

import pytest
import torch
from peft import IA3Config, LoraConfig, PromptTuningConfig

from adapterserve import Engine
from adapterserve.adapters_store.cache import tensor_nbytes
from adapterserve.adapters_store.fit import adapter_validator, backbone_facts, check_fits
from adapterserve.adapters_store.formats.read import read_adapter
from adapterserve.adapters_store.servable import ServingRules, check_servable
from adapterserve.errors import AdapterError
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=64, max_lora_rank=8)


@pytest.fixture(scope="module")
def static(engine):
    """The facts a replica reports, through JSON as ServerInfo carries them to the CLI."""
    facts = backbone_facts("tiny-llama", engine.backbone_spec, engine.adapter_limits, engine.serving_rules)
    return json.loads(json.dumps(facts))


UNFIT = {
    "ia3_on_a_fused_input": IA3Config(task_type="CAUSAL_LM", target_modules=["gate_proj", "down_proj"],
                                      feedforward_modules=["gate_proj"]),
    "lora_rank_over_the_limit": LoraConfig(task_type="CAUSAL_LM", r=16, target_modules=["q_proj"]),
    "too_many_virtual_tokens": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=100),
}


@pytest.mark.parametrize("case", sorted(UNFIT))
def test_upload_and_engine_refuse_alike(engine, static, llama_dir, tmp_path, case):
    path = make_peft_adapter(llama_dir, tmp_path / case, UNFIT[case])
    with pytest.raises(AdapterError) as by_engine:
        engine.load_adapter("x", path)
    with pytest.raises(AdapterError) as by_upload:
        check_fits(path, static, "x")
    assert str(by_upload.value) == str(by_engine.value)
    assert "x" not in engine.list_adapters()


@pytest.mark.parametrize("family", ["ia3", "prompt", "p-tuning", "prefix", "lora"])
def test_every_fit_family_passes_both(engine, static, llama_dir, tmp_path, family):
    if family == "lora":
        path = make_peft_lora(llama_dir, tmp_path / family, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    else:
        path = make_peft_adapter(llama_dir, tmp_path / family, family_configs()[family])
    info = adapter_validator([static], family)(path)
    assert info["backbone"] == "tiny-llama" and info["kind"]
    engine.load_adapter(family, path)
    engine.unload_adapter(family)


def test_the_rules_survive_the_wire(engine, static):
    rules = engine.serving_rules
    assert ServingRules.from_dict(static["servable"]) == rules
    assert "gate_proj" in rules.ia3_fused_kinds and rules.virtual_tokens


def test_an_encoder_refuses_virtual_tokens_as_uploads_do(engine, llama_dir, tmp_path):
    adapter = read_adapter(make_peft_adapter(llama_dir, tmp_path / "p", family_configs()["prompt"]),
                           engine.backbone_spec, engine.adapter_limits, name="p")
    with pytest.raises(AdapterError, match="served on decoder backbones only"):
        check_servable(adapter, "p", ServingRules(virtual_tokens=False))


def test_weights_of_another_format_beside_the_adapter_are_refused(static, llama_dir, tmp_path):
    path = make_peft_lora(llama_dir, tmp_path / "l", r=4, lora_alpha=8, target_modules=["q_proj"])
    (path / "adapter.safetensors").write_bytes((path / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match="'adapter.safetensors' belongs to another format"):
        check_fits(path, static, "l")


def test_host_copies_are_kept_in_the_serving_dtype(engine, llama_dir, tmp_path):
    path = make_peft_lora(llama_dir, tmp_path / "l", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    spec, limits = engine.backbone_spec, engine.adapter_limits
    full = read_adapter(path, spec, limits, name="l")
    half = read_adapter(path, spec, limits, name="l", dtype=torch.bfloat16)
    assert {m.a.dtype for m in half.lora.modules.values()} == {torch.bfloat16}
    assert tensor_nbytes(half) * 2 == tensor_nbytes(full)
    for key, module in full.lora.modules.items():  # the same values, rounded once
        torch.testing.assert_close(half.lora.modules[key].b, module.b.to(torch.bfloat16), rtol=0, atol=0)


def test_a_value_the_serving_dtype_cannot_hold_is_refused(engine, llama_dir, tmp_path):
    path = make_peft_adapter(llama_dir, tmp_path / "ia3", family_configs()["ia3"])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(iter(tensors))
    tensors[key] = tensors[key] * 1e6  # fine in float32, over float16's 65504
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="too large for float16, the dtype this server serves in"):
        read_adapter(path, engine.backbone_spec, engine.adapter_limits, name="ia3", dtype=torch.float16)
