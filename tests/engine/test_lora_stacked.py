"""lora_decode="stacked" (and "fused"): LoRA A rows under the base weight, one GEMM for base
output and shrink (with "fused", A rows kept apart: a step with few adapters runs each linear
in one launch, the others the segmented kernels).
A mixed batch against PEFT + transformers one request at a time (float32, CPU);
adapters placed and evicted while others decode, and the per-step choice of expand,
against the segmented kernels' engine; every family in one batch."""
from itertools import product

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.engine.test_lora_mixed import ADAPTERS, MAX_TOKENS, assert_matches_peft_alone
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import record_logits


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q|k|v bias through the stacked expand
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"stacked-{request.param}")
    model_dir = write_tiny_checkpoint(root / "model", request.param, seed=23)
    adapters = {
        name: make_peft_lora(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    return model_dir, adapters


def _prompts(vocab: int, count: int, gen: torch.Generator) -> list[list[int]]:
    """Prompts whose first step holds more than 256 tokens: prefill runs the segmented
    kernels on the stacked pool's views, decode the stacked GEMM."""
    return [torch.randint(3, vocab, (int(torch.randint(16, 25, (), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


@pytest.mark.parametrize("mode", ["stacked", "fused"])
def test_stacked_mixed_batch_matches_peft_alone(setup, mode):
    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_lora_rank=64, max_loras=8, lora_decode=mode)
    for _, linear in engine.model.adapter_linears():  # "fused": the A rows in a buffer of their own
        joint = linear.stacked is not None and linear.weight.data_ptr() == linear.stacked.buffer.data_ptr()
        assert linear.stacked is not None and linear.stacked.joint == joint == (mode == "stacked")
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    ids = [None] + list(adapter_dirs) + [None] + list(adapter_dirs)[::-1]
    prompts = _prompts(engine.model_config.vocab_size, len(ids), torch.Generator().manual_seed(3))
    assert sum(map(len, prompts)) > 256

    captured = record_logits(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), adapter_ids=ids)

    assert engine.lora_pool.stacked_rows() > 0
    assert_matches_peft_alone(model_dir, adapter_dirs, ids, prompts, outs, captured)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


# float32 both ways; on a GPU the segmented kernels' prefill dots run in TF32 (tl.dot's
# default), so the two engines' logits differ by more than float32 rounding there
LOGIT_TOLERANCE = {"cpu": 1e-4, "cuda": 1e-3}


@pytest.mark.parametrize("device", DEVICES)
def test_stacked_places_and_evicts_while_others_decode(setup, device):
    """Three slots for eight adapters with a tight row pool: adapters come and go between
    decode steps (the row bucket, and on a GPU the captured graph, with them); every request
    gets the tokens the segmented kernels' engine gives it with room for all (float32)."""
    model_dir, adapter_dirs = setup
    tight = Engine.from_pretrained(model_dir, device, max_lora_rank=64, max_loras=3, lora_pool_rows=96,
                                   lora_decode="stacked", warmup=False)
    roomy = Engine.from_pretrained(model_dir, device, max_lora_rank=64, max_loras=8, lora_decode="kernels",
                                   warmup=False)
    for engine in (tight, roomy):
        for name, path in adapter_dirs.items():
            engine.load_adapter(name, path)
    ids = list(adapter_dirs) * 2 + [None]
    prompts = _prompts(tight.model_config.vocab_size, len(ids), torch.Generator().manual_seed(4))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    rows_seen: set[int] = set()
    step = tight.step

    def recording_step():
        rows_seen.add(tight.lora_pool.stacked_rows())
        return step()

    tight.step = recording_step
    got_logits, want_logits = record_logits(tight), record_logits(roomy)
    got = tight.generate(prompts, params, adapter_ids=ids)
    want = roomy.generate(prompts, params, adapter_ids=ids)
    _assert_same_outputs(got, want, got_logits, want_logits, device)
    assert tight.slots.evictions > 0
    assert len(rows_seen - {0}) > 1, rows_seen


@pytest.mark.parametrize("mode", ["stacked", "fused"])
@pytest.mark.parametrize("device", DEVICES)
def test_stacked_expand_follows_the_step_s_distinct_adapters(setup, device, mode):
    """Eight adapters decoding together, then fewer as requests end: each step runs the
    grouped expand from GROUPED_MIN_ADAPTERS distinct adapters on, the tiled one below; with
    lora_decode="fused" the fused linear from FUSED_MAX_ADAPTERS down and the separate kernels
    above (on a GPU a decode graph per choice); every request gets the segmented kernels'
    engine's tokens (float32)."""
    from adapterserve.kernels.stacked import GROUPED_MIN_ADAPTERS, choose_expand
    from adapterserve.layers.context import get_context

    model_dir, adapter_dirs = setup
    stacked = Engine.from_pretrained(model_dir, device, max_lora_rank=64, max_loras=8, lora_decode=mode,
                                     warmup=False)
    kernels = Engine.from_pretrained(model_dir, device, max_lora_rank=64, max_loras=8, lora_decode="kernels",
                                     warmup=False)
    for engine in (stacked, kernels):
        for name, path in adapter_dirs.items():
            engine.load_adapter(name, path)
    ids = list(adapter_dirs) + [None] + list(adapter_dirs)[:3]
    assert len(set(ids) - {None}) >= GROUPED_MIN_ADAPTERS
    prompts = _prompts(stacked.model_config.vocab_size, len(ids), torch.Generator().manual_seed(6))
    params = [SamplingParams(max_tokens=2 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(ids))]

    steps: list[tuple[int, int, int, str]] = []  # (distinct adapters, rows, row bucket, expand) of each eager
    # forward with LoRA rows

    def record(_module, _args):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # a decode graph captured lazily: reading the slots would sync inside the capture
        meta = get_context().lora
        if meta is not None:
            slots = meta.token_slots
            steps.append((len(set(slots[slots >= 0].tolist())), len(slots), stacked.lora_pool.stacked_rows(),
                          meta.stacked_expand))

    _hooked_run_matches(stacked, kernels, record, prompts, params, ids, device)
    fused = mode == "fused"
    fused_rows = stacked.lora_pool.fused_rows
    assert bool(fused_rows) == fused
    assert all(expand == choose_expand(distinct, rows, fused_rows, bucket) for distinct, rows, bucket, expand in steps)
    graphs = stacked.runner.graphs
    chosen = {step[3] for step in steps} | ({key[3] for key in graphs._graphs} if graphs is not None else set())
    assert ({"tiled", "fused"} if fused else {"tiled", "grouped"}) <= chosen, steps


def test_decode_graph_keys_follow_the_stacked_row_bucket(setup):
    """A captured decode graph holds the stacked GEMMs' shape: the row bucket is in the key of
    every graph with LoRA rows and of no other; the kernels layout adds nothing to any key
    (its graphs keep the keys warm-up captures them under)."""
    from adapterserve.engine.graphs import _key

    model_dir, _ = setup
    stacked = Engine.from_pretrained(model_dir, max_lora_rank=64, max_loras=3, lora_pool_rows=96,
                                     lora_decode="stacked")
    pool = stacked.lora_pool
    for _, linear in stacked.model.adapter_linears():
        assert linear.stacked.rows_in_use is pool.rows_in_use  # the one host value the stacked ops read
    assert pool.row_buckets() == [16, 32, 64, 96]
    mixes = list(product((False, True), repeat=3))  # (lora, ia3, bottleneck) rows in the batch
    keys = {}
    for rows in pool.row_buckets():
        with pool.covering(rows):
            assert pool.stacked_rows() == rows
            signature = stacked.runner.graph_signature()
            keys[rows] = {mix: _key(8, mix, signature) for mix in mixes}
    assert pool.stacked_rows() == 0
    for mix in mixes:
        assert len({keys[rows][mix] for rows in keys}) == (len(keys) if mix[0] else 1), mix
    with pool.covering(16):  # the stacked expand: in the key of graphs with LoRA rows only
        signature = stacked.runner.graph_signature()
        for mix in mixes:
            assert (_key(8, mix, signature, "tiled") != _key(8, mix, signature, "grouped")) == mix[0], mix
    with pytest.raises(ValueError, match="row buckets"), pool.covering(48):
        pass

    kernels = Engine.from_pretrained(model_dir, max_lora_rank=64, max_loras=3, lora_pool_rows=96,
                                     lora_decode="kernels")
    assert kernels.lora_pool.row_buckets() == []
    no_lora = ((), "all", ())  # the (IA)^3 part only: every scale outside a step
    for mix in mixes:
        assert _key(8, mix, kernels.runner.graph_signature()) == _key(8, mix, no_lora), mix
        assert _key(8, mix, kernels.runner.graph_signature(), "grouped") == _key(8, mix, no_lora), mix


def test_stacked_refuses_a_foreign_weight_dtype(tmp_path):
    from adapterserve.engine.pools.lora import LoraPool
    from adapterserve.models.loader import load_decoder

    model_dir = write_tiny_checkpoint(tmp_path / "model", "llama", seed=1)
    model, _ = load_decoder(model_dir, torch.float32, "cpu")
    with pytest.raises(ValueError, match="lora_decode='kernels'"):
        LoraPool(list(model.adapter_linears()), 2, 32, 16, torch.float16, "cpu", stacked=True)


def test_stacked_with_every_family_in_one_batch(tmp_path):
    """LoRA rows beside (IA)^3, prompt/prefix tuning and bottleneck adapters in one batch:
    the stacked engine gives every request the kernels engine's tokens."""
    from tests.engine.test_all_families import FIXTURES, MODEL
    from tests.helpers.families import family_configs, make_peft_adapter

    dirs = {name: make_peft_adapter(MODEL, tmp_path / name, cfg, seed=i)
            for i, (name, cfg) in enumerate(family_configs().items())}
    dirs["lora"] = make_peft_lora(MODEL, tmp_path / "lora", r=8, lora_alpha=16, target_modules="all-linear")
    dirs["houlsby"] = FIXTURES / "llama-houlsby"
    engines = [Engine.from_pretrained(MODEL, max_loras=16, lora_decode=mode) for mode in ("stacked", "kernels")]
    for engine in engines:
        for name, path in dirs.items():
            engine.load_adapter(name, path)
    ids = [None, *dirs, "lora"]
    prompts = _prompts(engines[0].model_config.vocab_size, len(ids), torch.Generator().manual_seed(5))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got, want = (engine.generate(prompts, params, adapter_ids=ids) for engine in engines)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.token_ids != got[0].token_ids for o in got[1:]) >= len(dirs) // 2  # the adapters matter


def test_lora_decode_names_the_choices():
    from adapterserve.config import EngineConfig

    with pytest.raises(ValueError, match="lora_decode must be one of"):
        EngineConfig(lora_decode="fuse")
    with pytest.raises(ValueError, match='lora_decode="stacked" stores LoRA A rows'):
        EngineConfig(lora_decode="stacked", dtype="fp8")
    assert EngineConfig(lora_decode="fused", dtype="fp8").lora_decode == "fused"  # A rows kept apart
    with pytest.raises(ValueError, match="decode_gemm must be one of"):
        EngineConfig(decode_gemm="cutlass")


def test_auto_lora_decode_fuses_on_hopper_only(monkeypatch):
    """The default, "auto": the fused linear on CUDA devices of sm_90 on (where it measured faster),
    the separate kernels elsewhere; a named choice stays what it says."""
    from adapterserve.config import EngineConfig

    assert EngineConfig().lora_decode == "auto"
    assert EngineConfig().lora_decode_used == "kernels"  # the CPU
    assert EngineConfig(max_loras=3, max_lora_rank=8).pool_rows == 24
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, used in {(8, 0): "kernels", (8, 9): "kernels", (9, 0): "fused", (10, 0): "fused"}.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        config = EngineConfig(device="cuda", max_loras=3, max_lora_rank=8)
        assert (config.lora_decode_used, config.pool_rows) == (used, 32 if used == "fused" else 24), capability
        assert EngineConfig(device="cuda", lora_decode="kernels").lora_decode_used == "kernels"
    assert EngineConfig(device="cpu", lora_decode="fused").lora_decode_used == "fused"


def test_fused_pools_keep_a_multiple_of_16_rows():
    """The fused linear's kernel is compiled for row buckets divisible by 16: a "fused" pool rounds
    its rows up (every bucket row_bucket can make is then one); the other layouts keep theirs."""
    from adapterserve.config import EngineConfig
    from adapterserve.kernels.stacked import row_bucket

    fused = EngineConfig(lora_decode="fused", max_loras=3, max_lora_rank=8)
    assert fused.pool_rows == 32
    assert EngineConfig(lora_decode="fused", max_lora_rank=16, lora_pool_rows=40).pool_rows == 48
    assert EngineConfig(lora_decode="kernels", max_loras=3, max_lora_rank=8).pool_rows == 24
    assert EngineConfig(lora_decode="stacked", max_lora_rank=16, lora_pool_rows=40).pool_rows == 40
    assert all(row_bucket(high, fused.pool_rows) % 16 == 0 for high in range(1, fused.pool_rows + 1))


def _assert_same_outputs(got, want, got_logits, want_logits, device: str) -> None:
    """Tokens identical; each request's last logits within the device's tolerance."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        last = len(a.token_ids) - 1
        g, w = got_logits[a.request_id][last], want_logits[b.request_id][last]
        assert (g - w).norm() / w.norm() < LOGIT_TOLERANCE[device], a.adapter_id


def _hooked_run_matches(engine: Engine, kernels: Engine, hook, prompts, params, adapter_ids, device: str) -> None:
    """engine generates with ``hook`` on its model's forward; kernels (the reference) without it:
    the same tokens and logits (_assert_same_outputs)."""
    handle = engine.model.register_forward_pre_hook(hook)
    got_logits, want_logits = record_logits(engine), record_logits(kernels)
    try:
        got = engine.generate(prompts, params, adapter_ids=adapter_ids)
    finally:
        handle.remove()
    want = kernels.generate(prompts, params, adapter_ids=adapter_ids)
    _assert_same_outputs(got, want, got_logits, want_logits, device)


def _every_adapter_resident(setup, mode: str) -> tuple[Engine, Engine, list[str]]:
    """An engine of this lora_decode with every adapter of setup resident and idle, placed in
    order from the pool's first rows, a segmented kernels' engine with them loaded, their names."""
    model_dir, adapter_dirs = setup
    engine = Engine.from_pretrained(model_dir, max_lora_rank=64, max_loras=8, lora_decode=mode, warmup=False)
    kernels = Engine.from_pretrained(model_dir, max_lora_rank=64, max_loras=8, lora_decode="kernels", warmup=False)
    for one in (engine, kernels):
        for name, path in adapter_dirs.items():
            one.load_adapter(name, path)
    for name in adapter_dirs:
        engine.slots.release(engine.slots.acquire(name, engine.adapters[name]))
    return engine, kernels, list(adapter_dirs)


@pytest.mark.parametrize("mode", ["stacked", "fused"])
def test_a_step_covers_its_own_adapters_rows_not_every_resident_one_s(setup, mode):
    """Every adapter resident, then a step on the one placed first: the stacked GEMMs (and the
    fused linear) cover the row bucket of that adapter's rows, not the pool's whole span, during
    the step and only then; the tokens are the segmented kernels' engine's."""
    import numpy as np

    engine, kernels, names = _every_adapter_resident(setup, mode)
    pool = engine.lora_pool
    first = engine.slots.slot_of[names[0]]
    span = pool.stacked_rows()
    with pool.for_step(np.array([first, -1, first])):
        own = pool.stacked_rows()
    assert 0 < own < span and pool.stacked_rows() == span
    with pool.for_step(np.array([-1, -1])):
        assert pool.stacked_rows() == 0

    seen: list[int] = []
    prompts = _prompts(engine.model_config.vocab_size, 3, torch.Generator().manual_seed(8))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _hooked_run_matches(engine, kernels, lambda _module, _args: seen.append(pool.stacked_rows()), prompts, params,
                        [names[0]] * 3, "cpu")
    assert set(seen) == {own}, seen


def test_a_few_adapter_step_above_the_fused_rows_takes_the_separate_kernels(setup, monkeypatch):
    """lora_decode="fused" with the fused linear's row limit set to 16 rows: decode steps on the
    adapter placed first, and on the one placed last above the others, run the fused linear over
    a window of 16 rows from their own lowest row; steps on both at once (their rows' span above
    the limit) the separate kernels, which read only their rows. All give the segmented kernels'
    engine's tokens and logits, through the decode graphs' path."""
    import adapterserve.kernels.stacked as stacked
    from adapterserve.engine.graphs import decode_graph_limits
    from adapterserve.layers.context import get_context

    monkeypatch.setattr(stacked, "FUSED_MAX_ROWS", {size: 16 for size in stacked.FUSED_MAX_ROWS})
    engine, kernels, names = _every_adapter_resident(setup, "fused")
    pool = engine.lora_pool
    assert pool.fused_rows == 16 and pool.stacked_rows() > 16
    engine.runner.enable_cuda_graphs(*decode_graph_limits(engine.config, engine.max_model_len))  # eager twins here

    steps: list[tuple[int, str]] = []  # (row bucket, expand) of each decode forward

    def record(_module, args):
        meta = get_context().lora
        if meta is not None and args[0].shape[0] <= stacked.FUSED_MAX_TOKENS:
            steps.append((pool.stacked_rows(), meta.stacked_expand))

    prompts = _prompts(engine.model_config.vocab_size, 2, torch.Generator().manual_seed(9))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for adapters, expand in (([names[0]] * 2, "fused"), ([names[-1]] * 2, "fused"), ([names[0], names[-1]], "tiled")):
        steps.clear()
        _hooked_run_matches(engine, kernels, record, prompts, params, adapters, "cpu")
        assert steps and {e for _, e in steps} == {expand}, (adapters, steps)
        assert all((rows <= 16) == (expand == "fused") for rows, _ in steps), (adapters, steps)
    assert engine.runner.graphs.replays > 0  # decode steps took the graph path (its eager twin on the CPU)
