"""read_adapterhub against files the adapters library wrote, and outputs it computed.

The fixtures under tests/fixtures/adapterhub/ come from
scripts/golden/make_adapterhub_fixtures.py (adapters 1.3 in its own environment).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapterserve.adapters_store.formats.adapterhub import read_adapterhub
from adapterserve.adapters_store.formats.types import (
    BackboneSpec,
    BottleneckAdapter,
    ClassifierHead,
)
from adapterserve.kernels.reference import ACTIVATIONS
from adapterserve.layers.bottleneck import (
    add_bottleneck_pools,
    encoder_adapter_meta,
    load_bottleneck,
)
from adapterserve.layers.context import BatchContext, set_context
from adapterserve.models.encoder_loader import default_encoder_dir, load_encoder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "adapterhub"
LLAMA_SPEC = BackboneSpec("llama", 2, 64, {})


@pytest.fixture(scope="module")
def minilm():
    model, _ = load_encoder(default_encoder_dir())
    return model


@pytest.fixture(scope="module")
def minilm_spec(minilm) -> BackboneSpec:
    return minilm.backbone_spec()


def _read(name: str, spec: BackboneSpec, max_rank: int = 64) -> BottleneckAdapter:
    return read_adapterhub(FIXTURES / name, spec, max_rank)


# reading


def test_reads_minilm_adapters_with_heads(minilm_spec):
    houlsby, pfeiffer = _read("minilm-houlsby", minilm_spec), _read("minilm-pfeiffer", minilm_spec)
    assert sorted(houlsby.modules) == [(i, p) for i in (0, 1, 3, 4, 5) for p in ("mh", "output")]  # leave_out=[2]
    assert sorted(pfeiffer.modules) == [(i, "output") for i in range(6)]
    assert (houlsby.rank, pfeiffer.rank) == (6, 12)  # 384 // 64, 384 // 32
    assert (houlsby.original_ln_before, pfeiffer.original_ln_before) == (False, True)
    assert {m.activation for m in houlsby.modules.values()} == {"silu"}  # adapters' "swish"
    assert {m.activation for m in pfeiffer.modules.values()} == {"relu"}
    assert houlsby.head.pooling == "cls" and [lay.activation for lay in houlsby.head.layers] == ["tanh", None]
    assert houlsby.head.id2label == {0: "negative", 1: "positive"}
    assert pfeiffer.head.pooling == "pooler" and pfeiffer.head.num_labels == 3 and len(pfeiffer.head.layers) == 1


def test_up_projection_is_stored_as_rows_of_w_up_transposed():
    adapter = _read("llama-houlsby", LLAMA_SPEC)
    raw = load_file(FIXTURES / "llama-houlsby" / "adapter.safetensors")
    module = adapter.modules[(1, "output")]
    prefix = "model.layers.1.output_adapters.adapters.houlsby."
    assert torch.equal(module.up, raw[prefix + "adapter_up.weight"].T)
    assert torch.equal(module.down, raw[prefix + "adapter_down.0.weight"])
    assert module.up.shape == module.down.shape == (16, 64)


def test_reads_llama_adapters():
    houlsby, pfeiffer = _read("llama-houlsby", LLAMA_SPEC), _read("llama-pfeiffer", LLAMA_SPEC)
    assert len(houlsby.modules) == 4 and houlsby.head is None and not houlsby.original_ln_before
    assert sorted(pfeiffer.modules) == [(0, "output"), (1, "output")] and pfeiffer.original_ln_before
    assert {m.activation for m in pfeiffer.modules.values()} == {"gelu"} and pfeiffer.rank == 8


def test_reads_the_shipped_example_adapter(minilm_spec):
    example = Path(__file__).resolve().parents[2] / "examples" / "adapters" / "topic-bottleneck"
    adapter = read_adapterhub(example, minilm_spec, max_rank=64)
    assert adapter.original_ln_before and adapter.rank == 24
    assert adapter.head.id2label == {0: "business", 1: "sports", 2: "tech"}


# numbers: one mixed batch on our encoder against adapters run one adapter at a time


def _head_logits(model, head: ClassifierHead, hidden: torch.Tensor) -> torch.Tensor:
    x = model.pooler(hidden[:, 0]) if head.pooling == "pooler" else hidden[:, 0]
    for layer in head.layers:
        x = torch.nn.functional.linear(x, layer.weight, layer.bias)
        x = ACTIVATIONS[layer.activation](x) if layer.activation else x
    return x


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def test_minilm_mixed_batch_matches_adapters_library(minilm, minilm_spec):
    expected = load_file(FIXTURES / "minilm_expected.safetensors")
    ids, mask = expected["input_ids"], expected["attention_mask"]
    adapters = {"houlsby": _read("minilm-houlsby", minilm_spec), "pfeiffer": _read("minilm-pfeiffer", minilm_spec)}
    slots = {"houlsby": 3, "pfeiffer": 1}
    batch = ids.shape[0]
    layers = minilm.layers
    add_bottleneck_pools(layers, 384, num_slots=4, max_rank=16, max_tokens=3 * ids.numel(),
                         dtype=torch.float32, device="cpu")
    try:
        for name, slot in slots.items():
            load_bottleneck(layers, slot, adapters[name])
        rows = torch.tensor([3] * batch + [-1] * batch + [1] * batch)  # houlsby, base, pfeiffer
        all_ids, all_mask = ids.repeat(3, 1), mask.repeat(3, 1)
        meta = encoder_adapter_meta(rows, all_mask, num_slots=4)
        set_context(BatchContext(attention=None, lora=None, lora_workspace=None, logits_rows=None, bottleneck=meta))
        with torch.no_grad():
            hidden = minilm(all_ids, all_mask)
        set_context(BatchContext(attention=None, lora=None, lora_workspace=None, logits_rows=None))
        with torch.no_grad():
            base = minilm(ids, mask)
    finally:
        for layer in layers:
            layer.bottleneck_mh = layer.bottleneck_output = None
        set_context(None)
    real = mask.bool()
    for name, part in (("houlsby", 0), ("pfeiffer", 2)):
        ours = hidden[part * batch : (part + 1) * batch]
        assert _rel(ours[real], expected[f"{name}.hidden"][real]) < 1e-4, name
        assert _rel(minilm.pool(ours, mask), expected[f"{name}.embedding"]) < 1e-4, name
        with torch.no_grad():
            logits = _head_logits(minilm, adapters[name].head, ours)
        assert _rel(logits, expected[f"{name}.logits"]) < 1e-4, name
        assert _rel(base[real], expected[f"{name}.hidden"][real]) > 0.1, "the adapter must change the output"
    assert _rel(hidden[batch : 2 * batch][real], base[real]) < 1e-5  # base rows untouched by their neighbours


def _bottleneck(h: torch.Tensor, module) -> torch.Tensor:
    return ACTIVATIONS[module.activation](h @ module.down.T + module.down_bias) @ module.up + module.up_bias


def _hook_llama(model, adapter: BottleneckAdapter) -> list:
    """The docstring's Llama placement, as forward hooks on transformers' LlamaForCausalLM."""
    handles = []
    for index, layer in enumerate(model.model.layers):
        saved = {}
        handles.append(layer.input_layernorm.register_forward_pre_hook(lambda m, a, s=saved: s.update(r1=a[0])))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, s=saved: s.update(r2=a[0])))
        for place, module, key in (("mh", layer.self_attn, "r1"), ("output", layer.mlp, "r2")):
            bottleneck = adapter.modules.get((index, place))
            if bottleneck is None:
                continue

            def hook(mod, args, out, b=bottleneck, s=saved, k=key):
                x = out[0] if isinstance(out, tuple) else out
                h = x + s[k] if adapter.original_ln_before else x
                x = x + _bottleneck(h, b)
                return (x, *out[1:]) if isinstance(out, tuple) else x

            handles.append(module.register_forward_hook(hook))
    return handles


@pytest.mark.parametrize("name", ["houlsby", "pfeiffer"])
def test_llama_placement_reproduces_adapters_library(name):
    from transformers import AutoModelForCausalLM

    expected = json.loads((FIXTURES / "llama_expected.json").read_text())
    logits = load_file(FIXTURES / "llama_expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(str(FIXTURES / "tiny-llama"), dtype=torch.float32).eval()
    handles = _hook_llama(model, _read(f"llama-{name}", LLAMA_SPEC))
    for i, prompt in enumerate(expected["prompts"]):
        ids, steps = list(prompt), []
        with torch.no_grad():
            for _ in range(expected["steps"]):
                steps.append(model(torch.tensor([ids])).logits[0, -1])
                ids.append(int(steps[-1].argmax()))
        assert ids[len(prompt):] == expected["tokens"][name][i]
        assert _rel(torch.stack(steps), logits[f"{name}.logits.{i}"]) < 1e-4
    for handle in handles:
        handle.remove()
    assert expected["tokens"][name] != expected["tokens"]["base"]


def test_tiny_llama_fixture_loads_in_our_decoder():
    from adapterserve import Engine, SamplingParams

    expected = json.loads((FIXTURES / "llama_expected.json").read_text())
    engine = Engine.from_pretrained(FIXTURES / "tiny-llama")
    params = SamplingParams(max_tokens=expected["steps"], temperature=0.0, ignore_eos=True)
    outs = engine.generate(expected["prompts"], params)
    assert [out.token_ids for out in outs] == expected["tokens"]["base"]


# refusals


def _config_edit(**changes):
    def edit(root: Path) -> None:
        file = root / "adapter_config.json"
        full = json.loads(file.read_text())
        full["config"].update(changes)
        file.write_text(json.dumps(full))
    return edit


def _top_edit(**changes):
    def edit(root: Path) -> None:
        file = root / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    return edit


def _weights_edit(change):
    def edit(root: Path) -> None:
        file = root / "adapter.safetensors"
        state = load_file(file)
        change(state)
        save_file(state, file)
    return edit


def _head_edit(**changes):
    def edit(root: Path) -> None:
        file = root / "head_config.json"
        full = json.loads(file.read_text())
        full["config"].update(changes)
        file.write_text(json.dumps(full))
    return edit


def _first(state: dict, suffix: str) -> str:
    return next(k for k in sorted(state) if k.endswith(suffix))


def _set_nan(state):
    state[_first(state, "adapter_up.weight")][0, 0] = float("nan")


BAD = {  # case -> (fixture, edit, message fragment)
    "pickle_only": ("minilm-pfeiffer", lambda r: (r / "adapter.safetensors").rename(r / "pytorch_adapter.bin"),
                    "pickle.*use_safetensors=True"),
    "no_config": ("minilm-pfeiffer", lambda r: (r / "adapter_config.json").unlink(), "no adapter_config.json"),
    "bad_json": ("minilm-pfeiffer", lambda r: (r / "adapter_config.json").write_text("{"), "not valid JSON"),
    "config_string": ("minilm-pfeiffer", _top_edit(config="pfeiffer"), "needs 'config' as an object"),
    "gating": ("minilm-pfeiffer", _config_edit(use_gating=True), "gated"),
    "parallel": ("minilm-pfeiffer", _config_edit(is_parallel=True), "parallel"),
    "own_ln_after": ("minilm-houlsby", _config_edit(ln_after=True), "ln_after"),
    "own_ln_before": ("minilm-houlsby", _config_edit(ln_before=True), "ln_before"),
    "no_ln_after": ("minilm-houlsby", _config_edit(original_ln_after=False), "original_ln_after"),
    "post_add": ("minilm-pfeiffer", _config_edit(residual_before_ln="post_add"), "residual_before_ln"),
    "compacter": ("minilm-pfeiffer", _config_edit(phm_layer=True), "Compacter"),
    "invertible": ("minilm-pfeiffer", _config_edit(inv_adapter="nice"), "invertible"),
    "learned_scaling": ("minilm-pfeiffer", _config_edit(scaling="learned"), "learned scaling"),
    "lora_architecture": ("minilm-pfeiffer", _config_edit(architecture="lora"), "'lora' adapters"),
    "unknown_option": ("minilm-pfeiffer", _config_edit(new_trick=1), "unknown option 'new_trick'"),
    "activation": ("minilm-pfeiffer", _config_edit(non_linearity="leakyrelu"), "non_linearity 'leakyrelu'"),
    "adapts_nothing": ("minilm-pfeiffer", _config_edit(output_adapter=False), "adapts nothing"),
    "wrong_reduction": ("minilm-houlsby", _config_edit(reduction_factor=32), r"shape \(6, 384\).*expected \(12, 384\)"),
    "leave_out_missing": ("minilm-houlsby", _config_edit(leave_out=[]), "layer 2 .*has no weights"),
    "leave_out_extra": ("minilm-pfeiffer", _config_edit(leave_out=[1]), "layer 1 .*has none there"),
    "other_model_type": ("minilm-pfeiffer", _top_edit(model_type="roberta"), "model_type='roberta'"),
    "other_hidden": ("minilm-pfeiffer", _top_edit(hidden_size=768), "hidden_size=768"),
    "other_name": ("minilm-pfeiffer", _top_edit(name="sentiment"), "names 'sentiment'"),
    "nan": ("minilm-pfeiffer", _weights_edit(_set_nan), "NaN"),
    "missing_part": ("minilm-pfeiffer", _weights_edit(lambda s: s.pop(_first(s, "adapter_up.bias"))), "lacks up.bias"),
    "int_weights": ("minilm-pfeiffer", _weights_edit(
        lambda s: s.update({(k := _first(s, "down.0.bias")): s[k].long()})), "floating point"),
    "stray_tensor": ("minilm-pfeiffer", _weights_edit(lambda s: s.update({"bert.pooler.dense.weight": torch.ones(2)})),
                     "unexpected tensor 'bert.pooler.dense.weight'"),
    "head_type": ("minilm-houlsby", _head_edit(head_type="tagging"), "only classification heads"),
    "head_labels": ("minilm-houlsby", _head_edit(num_labels=5, label2id=None), r"expected \(5, 384\)"),
    "head_label2id": ("minilm-houlsby", _head_edit(label2id={"a": 0, "b": 7}), "label2id"),
    "head_layers": ("minilm-houlsby", _head_edit(layers=1), r"head tensor 1.weight .*expected \(2, 384\)"),
    "head_extra": ("minilm-pfeiffer", lambda r: save_file(
        {**load_file(r / "model_head.safetensors"), "heads.pfeiffer.4.weight": torch.ones(3, 384)},
        r / "model_head.safetensors"), "weights at position"),
    "head_pickle": ("minilm-houlsby", lambda r: (r / "model_head.safetensors").rename(r / "pytorch_model_head.bin"),
                    "pytorch_model_head.bin, a pickle"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_refuses_malformed(case, tmp_path, minilm_spec):
    from adapterserve.errors import AdapterError

    fixture, edit, message = BAD[case]
    root = shutil.copytree(FIXTURES / fixture, tmp_path / case)
    edit(root)
    with pytest.raises(AdapterError, match=message):
        read_adapterhub(root, minilm_spec, max_rank=64)


def test_refuses_unfit_backbones(minilm_spec):
    from dataclasses import replace

    from adapterserve.errors import AdapterError

    with pytest.raises(AdapterError, match="backbone has 4 layers"):
        _read("minilm-pfeiffer", replace(minilm_spec, num_layers=4))
    with pytest.raises(AdapterError, match="not served on qwen2"):
        _read("llama-pfeiffer", replace(LLAMA_SPEC, model_type="qwen2"))
    with pytest.raises(AdapterError, match="maximum 8"):
        _read("minilm-pfeiffer", minilm_spec, max_rank=8)
    with pytest.raises(AdapterError, match="saved for model_type='llama'"):
        _read("llama-pfeiffer", replace(minilm_spec, hidden_size=64, num_layers=2))
