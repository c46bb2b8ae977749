"""FP8 backbones load: float checkpoints quantized per channel at load, and FP8 checkpoints
written here in compressed-tensors / fbgemm_fp8 / fp8 layouts; wrong layouts are refused
with an error naming the tensor or field."""
import json

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.config import EngineConfig
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.models.fp8_checkpoints import (
    QUANT_CONFIGS,
    channel_quantized,
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
)

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "float", "qwen2", seed=5)


def _engine(path, dtype):
    return Engine.from_pretrained(path, dtype=dtype, block_size=8, num_kv_blocks=64, max_loras=2)


def _prompts():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 11, 20)]


def test_quantize_at_load_stores_e4m3_weights_with_channel_scales(float_dir):
    engine = _engine(float_dir, "fp8")
    qkv = engine.model.layers[0].qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
    assert engine.model.embed_tokens.weight.dtype == torch.float32  # the rest stays in the activations' dtype
    from safetensors.torch import load_file

    q, scale = channel_quantized(load_file(str(float_dir / "model.safetensors"))[Q_PROJ])
    rows = q.shape[0]
    assert torch.equal(qkv.weight[:rows].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qkv.weight_scale[:rows], scale[:, 0])
    assert qkv.bias is not None and qkv.bias.dtype == torch.float32  # qwen2's q/k/v bias


@pytest.mark.parametrize("layout", sorted(QUANT_CONFIGS))
def test_fp8_checkpoint_means_its_dequantized_weights(float_dir, tmp_path, layout):
    """An FP8 checkpoint runs as the float32 checkpoint of its dequantized weights does, in a
    float32 engine and in an fp8 one (which keeps the stored weights and scales); block
    scales are re-quantized per channel, as the dequantized checkpoint is at load."""
    fp8_dir = write_fp8_checkpoint(float_dir, tmp_path / "fp8", layout)
    plain_dir = write_dequantized_checkpoint(fp8_dir, tmp_path / "plain")
    prompts = _prompts()
    want = _engine(plain_dir, "float32").generate(prompts, GREEDY)
    for dtype in ("float32", "fp8"):
        if dtype == "fp8" and layout == "fp8-block":
            want = _engine(plain_dir, "fp8").generate(prompts, GREEDY)
        got = _engine(fp8_dir, dtype).generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], (layout, dtype)


def _spoiled(float_dir, tmp_path, edit, layout="compressed-tensors"):
    return write_fp8_checkpoint(float_dir, tmp_path / "bad", layout, edit=edit)


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    def edit(t):
        t[name] = value(t)
    return edit


BAD_TENSORS = {
    "missing scale": (_drop(Q_PROJ + "_scale"), "q_proj.weight_scale'.*missing"),
    "scale of wrong shape": (_set(Q_PROJ + "_scale", lambda t: torch.ones(3, 1)), "q_proj.weight_scale.*shape \\(3, 1\\)"),
    "NaN scale": (_set(Q_PROJ + "_scale", lambda t: t[Q_PROJ + "_scale"].index_fill(0, torch.tensor([2]), float("nan"))),
                  "q_proj.weight_scale.*not a finite positive number \\(nan at flat index 2\\)"),
    "zero scale": (_set(Q_PROJ + "_scale", lambda t: torch.zeros_like(t[Q_PROJ + "_scale"])), "not a finite positive"),
    "e5m2 weight": (_set(Q_PROJ, lambda t: t[Q_PROJ].float().to(torch.float8_e5m2)), "float8_e5m2.*float8_e4m3fn"),
    "scale beside a float weight": (_set(Q_PROJ, lambda t: t[Q_PROJ].float()), "q_proj.weight_scale.*without a float8"),
    "float8 bias": (_set("model.layers.0.self_attn.q_proj.bias",
                         lambda t: t["model.layers.0.self_attn.q_proj.bias"].to(torch.float8_e4m3fn)),
                    "q_proj.bias.*only 2-D linear weights"),
    "wrong weight shape": (_set(Q_PROJ, lambda t: t[Q_PROJ][:-1].contiguous()), "q_proj.weight.*shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
@pytest.mark.parametrize("dtype", ["fp8", "float32"])
def test_bad_fp8_tensors_are_refused_naming_the_tensor(float_dir, tmp_path, case, dtype):
    edit, message = BAD_TENSORS[case]
    with pytest.raises(ValueError, match=message):
        _engine(_spoiled(float_dir, tmp_path, edit), dtype)


def test_block_scales_of_wrong_shape_are_refused(float_dir, tmp_path):
    bad = _spoiled(float_dir, tmp_path, _set(Q_PROJ + "_scale_inv", lambda t: torch.ones(2, 2)), layout="fp8-block")
    with pytest.raises(ValueError, match="q_proj.weight_scale_inv.*blocks of 16x32 over a \\[64, 64\\] weight"):
        _engine(bad, "fp8")


def _with_quant_config(float_dir, tmp_path, quant_config):
    path = write_fp8_checkpoint(float_dir, tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(cfg))
    return path


BAD_CONFIGS = {
    "awq": ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    "int4 compressed-tensors": (
        {"quant_method": "compressed-tensors",
         "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}},
        "config_groups.group_0.weights is 'int' with 4 bits",
    ),
    "bad block size": ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_unsupported_quantization_configs_are_refused(float_dir, tmp_path, case):
    quant_config, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        _engine(_with_quant_config(float_dir, tmp_path, quant_config), "fp8")


def test_fp8_settings_are_checked():
    assert EngineConfig(dtype="fp8").torch_dtype == torch.float32  # CPU: the float32 reference path
    assert EngineConfig(dtype="fp8", device="cuda").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="fp4")
    with pytest.raises(ValueError, match="fp8_gemm must be one of"):
        EngineConfig(dtype="fp8", fp8_gemm="cublas")


def test_serve_passes_dtype_fp8_to_the_engine(tmp_path):
    from adapterserve.clients import cli

    args = cli._parser().parse_args(["serve", "--model", str(tmp_path), "--dtype", "fp8"])
    assert cli.serve_config(args)["engine"]["dtype"] == "fp8"
