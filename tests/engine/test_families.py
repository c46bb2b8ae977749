"""(IA)^3, prompt tuning, P-tuning and prefix tuning mixed with LoRA and base rows
in one batch, each request against PEFT running it alone (float32, CPU)."""
import pytest
import torch
from peft import PeftModel

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, greedy_by_forward, make_peft_adapter
from tests.helpers.lora import load_base, make_peft_lora
from tests.helpers.recording import record_logits

MAX_TOKENS = 7


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"families-{request.param}")
    model_dir = write_tiny_checkpoint(root / "model", request.param, seed=8)
    adapters = {name: make_peft_adapter(model_dir, root / name, cfg, seed=i)
                for i, (name, cfg) in enumerate(family_configs().items())}
    adapters["lora"] = make_peft_lora(model_dir, root / "lora", r=8, lora_alpha=16,
                                      target_modules=["q_proj", "v_proj", "down_proj"], seed=9)
    return model_dir, adapters


def _eos(engine) -> set[int]:
    return set(engine.model_config.eos_token_ids)


def test_every_family_in_one_batch_matches_peft_alone(setup):
    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_loras=8, block_size=4)
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    ids = [None, *adapter_dirs, *adapter_dirs, None]
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(1, 14, ())),)).tolist() for _ in ids]
    captured = record_logits(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), adapter_ids=ids)
    base = load_base(model_dir)
    for adapter, prompt, out in zip(ids, prompts, outs):
        model = base if adapter is None else PeftModel.from_pretrained(load_base(model_dir), adapter_dirs[adapter]).eval()
        tokens, logits = greedy_by_forward(model, prompt, MAX_TOKENS, _eos(engine))
        assert out.token_ids == tokens, adapter
        rel = (captured[out.request_id][len(out.token_ids) - 1] - logits).norm() / logits.norm()
        assert rel < 1e-4, (adapter, rel.item())
    assert engine.blocks.num_free + sum(len(b) for b in engine.prefix_pool.pages.values()) == engine.config.num_kv_blocks


def test_families_change_the_output(setup):
    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_loras=8)
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    names = list(adapter_dirs)
    outs = engine.generate([[4, 8, 15, 16, 23, 42]] * (len(names) + 1), params, adapter_ids=[None, *names])
    for name, out in zip(names, outs[1:]):
        assert out.token_ids != outs[0].token_ids, name


def test_prefix_blocks_are_shared_and_freed_with_the_slot(setup):
    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_loras=2, block_size=4, num_kv_blocks=64)
    engine.load_adapter("prefix", adapter_dirs["prefix"])
    engine.load_adapter("lora", adapter_dirs["lora"])
    engine.load_adapter("prompt", adapter_dirs["prompt"])
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7]] * 4, params, adapter_ids=["prefix"] * 4)
    assert engine.blocks.num_free == 64 - 2  # one 6-token prefix in two blocks, for all four requests
    engine.generate([[5, 6, 7]] * 2, params, adapter_ids=["lora", "prompt"])  # evicts the idle prefix
    assert engine.blocks.num_free == 64


def test_fused_feedforward_ia3_is_refused(setup, tmp_path):
    from peft import IA3Config

    from adapterserve.errors import AdapterError

    model_dir, _ = setup
    bad = make_peft_adapter(model_dir, tmp_path / "ia3-up", IA3Config(
        task_type="CAUSAL_LM", target_modules=["up_proj", "down_proj"], feedforward_modules=["up_proj"]))
    engine = Engine.from_pretrained(model_dir)
    with pytest.raises(AdapterError, match="up_proj"):
        engine.load_adapter("x", bad)
    assert engine.list_adapters() == []


@pytest.mark.parametrize("names", [("ia3",), ("ia3-attn",), ("ia3", "ia3-attn")], ids="+".join)
def test_ia3_steps_launch_only_the_scales_their_adapters_need(setup, names, monkeypatch):
    """A step whose (IA)^3 adapters scale only PEFT's default places (keys, values, down's input)
    launches those two scales a layer; one scaling any other place launches every scale but
    the fused projections' inputs (q|k|v and gate|up share theirs: no adapter may scale it).
    Each request's tokens and logits are PEFT's, run alone."""
    from adapterserve.layers import linear as linear_module

    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_loras=2)
    for name in names:
        engine.load_adapter(name, adapter_dirs[name])
    owners = {}
    for _, linear in engine.model.adapter_linears():
        owners[id(linear.ia3_out)] = (linear.slice_kinds[0], "out")
        assert (linear.ia3_in is None) == (len(linear.slice_kinds) > 1)
        if linear.ia3_in is not None:
            owners[id(linear.ia3_in)] = (linear.slice_kinds[0], "in")
    scaled = []
    original = linear_module.ia3_scale
    monkeypatch.setattr(linear_module, "ia3_scale", lambda x, scales, meta: (scaled.append(owners[id(scales)]),
                                                                            original(x, scales, meta)))
    prompts = [[4, 8, 15, 16], [23, 42, 7]][: len(names)]
    captured = record_logits(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                           adapter_ids=list(names))  # a prefill step and two decode steps
    peft_only = names == ("ia3",)
    want = {("q_proj", "out"), ("down_proj", "in")} if peft_only else {
        ("q_proj", "out"), ("o_proj", "out"), ("gate_proj", "out"), ("down_proj", "out"), ("o_proj", "in"),
        ("down_proj", "in")}
    assert set(scaled) == want and len(scaled) == len(want) * engine.model_config.num_layers * 3
    for name, prompt, out in zip(names, prompts, outs):
        model = PeftModel.from_pretrained(load_base(model_dir), adapter_dirs[name]).eval()
        tokens, logits = greedy_by_forward(model, prompt, 3, set())
        assert out.token_ids == tokens, name
        rel = (captured[out.request_id][2] - logits).norm() / logits.norm()
        assert rel < 1e-4, (name, rel.item())
