"""The engine on a GPU (Triton path, bfloat16) against its float32 reference path
(CPU ops), on a random Llama-shaped checkpoint with mixed adapters. The first test's engines
warm up as a server's do; the others skip warm-up (tens of seconds an engine), which their
comparisons do not depend on."""
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import record_logits

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    model_dir = write_tiny_checkpoint(root / "model", "llama", num_layers=4, hidden_size=1024, intermediate_size=2816,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=2048, seed=3)
    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {f"lora-r{r}": make_peft_lora(model_dir, root / f"r{r}", r=r, lora_alpha=2 * r,
                                            target_modules=all_linear, seed=r) for r in (8, 16, 64)}
    configs = family_configs()
    for name in ("ia3", "prompt", "prefix"):
        adapters[name] = make_peft_adapter(model_dir, root / name, configs[name], seed=len(name))
    return model_dir, adapters


def _first_step_logits(engine, prompts, ids):
    captured = record_logits(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), adapter_ids=ids)
    return [captured[o.request_id][0] for o in outs], outs


def _hf_bf16_drift(model_dir, prompts) -> tuple[float, float]:
    """How far transformers itself moves in bfloat16 from float32 on these prompts (base model):
    the largest relative logit error, and the share of prompts whose greedy next token stays."""
    from transformers import AutoModelForCausalLM

    errors, same = [], 0
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            want, got = fp32(ids).logits[0, -1], bf16(ids).logits[0, -1].float()
            errors.append(((got - want).norm() / want.norm()).item())
            same += int(got.argmax() == want.argmax())
    return max(errors), same / len(prompts)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_path_agrees_with_float32_reference(setup, dtype):
    model_dir, adapters = setup
    gpu = Engine.from_pretrained(model_dir, device="cuda", dtype=dtype, max_loras=8)
    ref = Engine.from_pretrained(model_dir, device="cpu", dtype="float32", max_loras=8)
    for engine in (gpu, ref):
        for name, path in adapters.items():
            engine.load_adapter(name, path)
    ids = [None, *adapters] * 4
    prompts = [torch.randint(3, 2048, (int(torch.randint(1, 200, ())),)).tolist() for _ in ids]
    got, gpu_outs = _first_step_logits(gpu, prompts, ids)
    want, ref_outs = _first_step_logits(ref, prompts, ids)
    # bfloat16: within 2x of what transformers' own bfloat16 run loses; float32: Triton's tf32 dots only
    hf_error, hf_same = _hf_bf16_drift(model_dir, prompts) if dtype == "bfloat16" else (0.0, 1.0)
    tol = 2.0 * hf_error + 5e-3 if dtype == "bfloat16" else 5e-3
    for adapter, g, w in zip(ids, got, want):
        assert torch.isfinite(g).all()
        rel = (g - w).norm() / w.norm()
        assert rel < tol, (adapter, rel.item(), tol)
    same_first = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(gpu_outs, ref_outs))
    # random weights give near-flat logits: in bfloat16 some greedy tokens flip for transformers too, so
    # the engine may flip at most 10% of the prompts more often than transformers does on the same prompts
    assert same_first >= (min(hf_same, 0.95) - 0.1 if dtype == "bfloat16" else 0.95) * len(ids), (same_first, hf_same)


def test_chunked_prefill_agrees_with_whole_prompts(setup):
    """Prompts (and prompt-tuning / prefix tokens) split over steps of 48 tokens, decodes
    first, against the same prompts run whole: the Triton prefill path over chunks."""
    model_dir, adapters = setup
    engines = [Engine.from_pretrained(model_dir, device="cuda", dtype="float32", max_loras=8,
                                      max_num_batched_tokens=budget, warmup=False) for budget in (4096, 48)]
    for engine in engines:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
    ids = [None, *adapters] * 2
    prompts = [torch.randint(3, 2048, (int(torch.randint(60, 200, ())),)).tolist() for _ in ids]
    (whole_logits, whole), (chunk_logits, chunked) = (_first_step_logits(e, prompts, ids) for e in engines)
    for adapter, a, b in zip(ids, whole_logits, chunk_logits):
        assert (a - b).norm() / a.norm() < 5e-3, adapter
    same = sum(a.token_ids == b.token_ids for a, b in zip(whole, chunked))
    assert same >= 0.9 * len(ids)


def _two_engines(setup, option: str, values=(True, False), **fixed):
    """Two bf16 GPU engines differing in one EngineConfig option (``fixed``: others both set),
    every adapter loaded; with mixed-adapter request ids and random prompts."""
    model_dir, adapters = setup
    engines = [Engine.from_pretrained(model_dir, device="cuda", dtype="bfloat16", max_loras=8, warmup=False,
                                 **fixed, **{option: v})
               for v in values]
    for engine in engines:
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        # place every adapter and let its copies land now: admission then does not depend on
        # when a copy lands, so both engines schedule the same steps (eager or graph)
        engine.generate([[1, 2, 3]] * len(adapters), SamplingParams(max_tokens=1), adapter_ids=list(adapters))
        torch.cuda.synchronize()
    ids = [None, *adapters] * 3
    prompts = [torch.randint(3, 2048, (int(torch.randint(1, 50, ())),)).tolist() for _ in ids]
    return engines, ids, prompts


def test_cuda_graph_decode_matches_eager(setup):
    engines, ids, prompts = _two_engines(setup, "cuda_graphs")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphed, eager = (e.generate(prompts, params, adapter_ids=ids) for e in engines)
    assert engines[0].runner.graphs._graphs, "no decode step ran as a graph"
    same = sum(a.token_ids == b.token_ids for a, b in zip(graphed, eager))
    assert same >= 0.9 * len(ids)


def test_lora_side_stream_gives_the_same_tokens_and_logits(setup):
    engines, ids, prompts = _two_engines(setup, "lora_side_stream", lora_decode="kernels")  # every step's shrink
    (side_logits, side), (plain_logits, plain) = (_first_step_logits(e, prompts, ids) for e in engines)
    assert engines[0].runner.graphs._graphs, "no decode step ran as a graph"
    assert [o.token_ids for o in side] == [o.token_ids for o in plain]
    for a, b in zip(side_logits, plain_logits):
        assert torch.equal(a, b)  # same kernels, same order of sums: bit-identical


def test_placements_copy_on_their_own_stream_and_report_when_landed(setup):
    model_dir, adapters = setup
    engine = Engine.from_pretrained(model_dir, device="cuda", dtype="bfloat16", max_loras=8, warmup=False)
    engine.load_adapter("r16", adapters["lora-r16"])
    assert engine.slots.copy_stream is not None
    adapter = engine.adapters["r16"]
    slot = engine.slots.acquire("r16", adapter)  # placed; held only if its copies have landed
    if slot is None:
        torch.cuda.synchronize()
        slot = engine.slots.acquire("r16", adapter)
    assert slot is not None and engine.slots.is_ready(slot)
    assert engine.slots.loads == 1 and engine.slots.heat("r16") == 1.0  # one placement, one admission
    engine.slots.release(slot)
