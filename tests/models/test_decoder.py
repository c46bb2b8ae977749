"""Our decoder against transformers' own implementation, float32 on CPU."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.recording import record_logits

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    shards = 3 if arch == "mistral" else 1
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, shards=shards, seed=11)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return arch, path, hf


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    lengths = [1, 7, 23, 40]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_logits_and_greedy_tokens_match_transformers(checkpoint):
    arch, path, hf = checkpoint
    engine = Engine.from_pretrained(path, block_size=8, num_kv_blocks=64)
    prompts = _prompts(hf.config.vocab_size)
    captured = record_logits(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, output_logits=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )
        assert out.token_ids == ref.sequences[0, len(prompt):].tolist(), arch
        for ours, theirs in zip(captured[out.request_id], ref.logits):
            rel = (ours - theirs[0]).norm() / theirs[0].norm()
            assert rel < 1e-4, (arch, rel.item())


def test_sliding_window_is_applied(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "mistral", seed=3)
    cfg_file = path / "config.json"
    import json

    cfg = json.loads(cfg_file.read_text())
    cfg["sliding_window"] = 6
    cfg_file.write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(path)
    prompt = torch.randint(3, cfg["vocab_size"], (30,)).tolist()
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, 30:].tolist()


def test_refuses_pickled_checkpoint(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "llama")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        Engine.from_pretrained(path)
