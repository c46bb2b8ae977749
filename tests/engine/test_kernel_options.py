"""Kernel options an engine applies: EngineConfig.pdl (which PDL mode an engine sets for its
process, and that it sets it; bit-identical outputs with PDL on: test_pdl_engine_gpu.py),
weight_prefetch (the process's prefetch; bit-identical outputs: the GEMMs' PDL graph tests) and
decode_attention_dots (set on every attention layer; its GPU numerics: test_attention_dots_gpu.py)."""
import pytest

from adapterserve import Engine
from adapterserve.config import EngineConfig
from adapterserve.engine.step_device import pdl_for
from adapterserve.kernels import attention, pdl


@pytest.fixture(autouse=True)
def _pdl_as_the_environment_says(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    pdl.set_pdl(None)
    pdl.set_prefetch(None)
    yield
    pdl.set_pdl(None)
    pdl.set_prefetch(None)


@pytest.mark.parametrize("options, mode", [
    (dict(device="cuda", dtype="fp8"), "early"),  # fp8_gemm auto: our decode GEMM on sm_90
    (dict(device="cuda", dtype="fp8", fp8_gemm="decode_weight_only"), "early"),
    (dict(device="cuda", dtype="fp8", fp8_gemm="scaled_mm"), "off"),  # cuBLAS: nothing for PDL to overlap
    (dict(device="cuda", dtype="bfloat16", lora_decode="kernels"), "off"),  # cuBLAS and the separate LoRA kernels
    (dict(device="cuda", dtype="bfloat16", lora_decode="fused"), "early"),  # the fused LoRA linear
    (dict(device="cpu", dtype="bfloat16", lora_decode="fused"), "off"),
    (dict(device="cpu", dtype="fp8"), "off"),
    (dict(device="cpu", dtype="float32", pdl="exit"), "exit"),  # asked for: as asked
    (dict(device="cuda", dtype="fp8", pdl="off"), "off"),
])
def test_auto_launches_early_where_decode_runs_our_gemms(options, mode):
    assert pdl_for(EngineConfig(**options)) == mode


def test_auto_leaves_a_set_environment_variable_in_charge(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "off")
    assert pdl_for(EngineConfig(device="cuda", dtype="fp8")) is None
    assert pdl_for(EngineConfig(device="cuda", dtype="fp8", pdl="early")) == "early"


def test_a_bad_mode_is_refused():
    for bad in ("on", "", True, None):
        with pytest.raises(ValueError, match="pdl must be one of"):
            EngineConfig(pdl=bad)


def test_the_engine_sets_its_process_mode(llama_dir):
    Engine.from_pretrained(llama_dir, num_kv_blocks=8, max_loras=1, pdl="exit")
    assert pdl.pdl_mode() == "exit"
    Engine.from_pretrained(llama_dir, num_kv_blocks=8, max_loras=1)  # auto on CPU
    assert pdl.pdl_mode() == "off"


def test_the_engine_sets_its_process_prefetch(llama_dir, monkeypatch):
    Engine.from_pretrained(llama_dir, num_kv_blocks=8, max_loras=1, weight_prefetch=4)
    assert pdl.prefetch_setting() == 4
    monkeypatch.setenv(pdl.PREFETCH_ENV, "2")
    Engine.from_pretrained(llama_dir, num_kv_blocks=8, max_loras=1)  # None: the environment's
    assert pdl.prefetch_setting() == 2


@pytest.mark.parametrize("env", [pdl.ENV, pdl.PREFETCH_ENV, attention.PDL_ENV, attention.TILES_ENV,
                                 attention.SPLITS_ENV])
def test_a_bad_environment_variable_stops_the_engine_s_build(llama_dir, monkeypatch, env):
    monkeypatch.setenv(env, "lots")
    with pytest.raises(ValueError, match=env):
        Engine.from_pretrained(llama_dir, num_kv_blocks=8, max_loras=1)


def test_decode_attention_joins_the_pdl_chain_unless_kept_out(monkeypatch):
    monkeypatch.delenv(attention.PDL_ENV, raising=False)
    assert attention.attention_in_chain() is attention.PDL is True  # on: its GPU bits tests passed
    monkeypatch.setenv(attention.PDL_ENV, "1")
    assert attention.attention_in_chain()
    monkeypatch.setenv(attention.PDL_ENV, "0")
    assert not attention.attention_in_chain()


BAD_OVERRIDES = [(attention.TILES_ENV, attention.forced_tiles, value) for value in (
    "64,4", "64,3,2", "8,4,2", "512,4,2", "64,4,9", "a,b,c", "64,4,-1", "32,4,3,split", "64,4,3,4")]
BAD_OVERRIDES += [(attention.SPLITS_ENV, attention.forced_splits, value)
                  for value in ("0", "3", "32", "-2", "two", "2.0")]


@pytest.mark.parametrize("env, read, value", BAD_OVERRIDES)
def test_decode_attention_overrides_refuse_a_bad_value(monkeypatch, env, read, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=env):
        read()


def test_decode_attention_tiles_take_the_override_for_every_launch(monkeypatch):
    monkeypatch.delenv(attention.TILES_ENV, raising=False)
    assert attention.decode_pipeline() == (attention.WARPS, attention.STAGES)
    assert attention.decode_blocks(64, 8, 1024) == (1, attention.WIDE_BLOCK_N)
    monkeypatch.setenv(attention.TILES_ENV, " 32,8,5 ")
    assert attention.decode_pipeline() == (8, 5)
    assert attention.decode_blocks(64, 8, 1024) == (1, 32)  # whole contexts
    assert attention.decode_blocks(2, 8, 8192) == (attention.decode_splits(2, 8, 8192), 32)  # split ones
    assert attention.decode_blocks(64, 8, 1024, on_gpu=False) == (1, 16)  # the CPU's own


def test_the_engine_sets_its_attention_layers_dots(llama_dir):
    engine = Engine.from_pretrained(llama_dir, num_kv_blocks=8, max_loras=1, decode_attention_dots="float32")
    assert {attn.decode_dots for attn in engine.model.attention_layers()} == {"float32"}
    plain = Engine.from_pretrained(llama_dir, num_kv_blocks=8, max_loras=1)
    assert {attn.decode_dots for attn in plain.model.attention_layers()} == {"auto"}


def test_decode_attention_splits_take_the_override_for_every_launch(monkeypatch):
    monkeypatch.delenv(attention.SPLITS_ENV, raising=False)
    assert attention.decode_splits(64, 8, 1024) == 1  # 512 programs: whole contexts
    monkeypatch.setenv(attention.SPLITS_ENV, " 2 ")
    assert attention.decode_splits(64, 8, 1024) == 2
    assert attention.decode_blocks(64, 8, 1024) == (2, attention.DEFAULT_BLOCK_N)
    assert attention.decode_blocks(64, 8, 1024, on_gpu=False) == (1, 16)  # the CPU's own

