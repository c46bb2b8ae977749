"""One generate call mixing eight PEFT LoRA adapters and base rows, against PEFT
+ transformers generating each request alone (float32, CPU)."""
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.lora import load_base, load_peft, make_peft_lora
from tests.helpers.recording import record_logits

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r1-q": dict(r=1, lora_alpha=2, target_modules=["q_proj"]),
    "r4-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8-all-rslora": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    "r16-o-down": dict(r=16, lora_alpha=16, target_modules=["o_proj", "down_proj"]),
    "r32-mlp": dict(r=32, lora_alpha=64, target_modules=["gate_proj", "up_proj"]),
    "r64-kv": dict(r=64, lora_alpha=32, target_modules=["k_proj", "v_proj"]),
    "patterns": dict(
        r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 2, "k_proj": 24}, alpha_pattern={"o_proj": 40},
    ),
    "r12-all-linear": dict(r=12, lora_alpha=6, target_modules="all-linear"),
}
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = write_tiny_checkpoint(root / "model", request.param, seed=21)
    adapters = {
        name: make_peft_lora(model_dir, root / name, seed=i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    return model_dir, adapters


def _reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, out.logits[len(_trim(tokens, model)) - 1][0]


def _trim(tokens: list[int], model) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def test_mixed_batch_matches_peft_alone(setup):
    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_lora_rank=64, max_loras=8)
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    vocab = engine.model_config.vocab_size
    ids = [None] + list(adapter_dirs) + [None] + list(adapter_dirs)[::-1]
    prompts = [torch.randint(3, vocab, (int(torch.randint(1, 25, ())),)).tolist() for _ in ids]

    captured = record_logits(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), adapter_ids=ids)

    assert_matches_peft_alone(model_dir, adapter_dirs, ids, prompts, outs, captured)
    assert engine.blocks.num_free == engine.config.num_kv_blocks


def test_adapters_change_the_output(setup):
    """Guards the comparison above against adapters too weak to matter."""
    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_lora_rank=64)
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    prompt = [5, 9, 33, 70, 2, 11]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [None] + list(adapter_dirs)
    outs = engine.generate([prompt] * len(ids), params, adapter_ids=ids)
    base_tokens = outs[0].token_ids
    assert sum(o.token_ids != base_tokens for o in outs[1:]) >= 6


def assert_matches_peft_alone(model_dir, adapter_dirs: dict, ids: list, prompts: list, outs: list,
                              captured: dict) -> None:
    """Each output against PEFT (or the base model) run on its prompt alone: greedy tokens
    identical, the last step's logits within 1e-4 (relative)."""
    base = load_base(model_dir)
    references = {name: load_peft(model_dir, path) for name, path in adapter_dirs.items()}
    for adapter, prompt, out in zip(ids, prompts, outs):
        model = base if adapter is None else references[adapter]
        tokens, logits = _reference(model, prompt)
        assert out.token_ids == _trim(tokens, model), adapter
        rel = (captured[out.request_id][len(out.token_ids) - 1] - logits).norm() / logits.norm()
        assert rel < 1e-4, (adapter, rel.item())
