"""The fp8 engine on a GPU (bfloat16 activations, CUDA graphs, each FP8 kernel) with LoRA
rows in the batch: every base product of its steps (run eagerly) against the float32 twin
of its kernel on the same input; its logits against float32 CPU engines on the dequantized and
on the unquantized weights. One set of fresh random prompts per run, shared by all engines."""
import pytest
import torch

from adapterserve import Engine
from adapterserve.kernels.fp8 import quantize_rows_reference
from adapterserve.layers.base_gemm import ACTIVATION_QUANTIZING, fp8_linear_oracle, resolve_fp8_gemm
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import greedy_logits_error, greedy_run
from tests.models.fp8_checkpoints import (
    GPU_MODEL,
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = [None, "lora", None, "lora"]
# one base product against its kernel's float32 twin on the same bf16 input: the twin rounds
# activations to e4m3 bit for bit as the kernel does, so only float32 summation order and the
# bf16 output rounding (2^-9 relative) remain
PROJECTION_REL_TOL = 5e-3
# first-token (and, while greedy tokens agree, decode) logits, relative L2 error. This random
# model (peaked attention, 4 layers) amplifies a small change of any layer's input about
# tenfold. Per-token e4m3 activations (about 3% per projection) then give 0.2-0.4 against the
# dequantized weights and 0.3-0.6 against the unquantized ones (measured by emulating the
# kernel on CPU); logits of an unrelated computation are about sqrt(2) = 1.41 away.
SCALED_MM_REL_TOL = 0.6
SCALED_MM_UNQUANTIZED_REL_TOL = 0.8
FUSED_REL_TOL = 1e-3  # fused vs unfused activation quantization, same kernel (see its test)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8gpu")
    float_dir = write_tiny_checkpoint(root / "float", "llama", **GPU_MODEL)
    dequantized = write_dequantized_checkpoint(write_fp8_checkpoint(float_dir, root / "fp8"), root / "dequantized")
    lora = make_peft_lora(float_dir, root / "r16", r=16, lora_alpha=32, target_modules=ALL_LINEAR, seed=4)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (1, 13, 64, 200)]
    return float_dir, dequantized, lora, prompts


def _engine(path, lora, **kwargs) -> Engine:
    """No warm-up unless asked (each costs tens of seconds; the test that needs its graphs asks)."""
    engine = Engine.from_pretrained(path, block_size=16, num_kv_blocks=256, max_loras=2, **{"warmup": False, **kwargs})
    engine.load_adapter("lora", lora)
    return engine


def _generate(engine, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: (greedy tokens, logits of prefill and 3 graph-replayed decodes)."""
    return greedy_run(engine, prompts, ADAPTERS, 4)


def _rel(got, want) -> float:
    return greedy_logits_error(got, want)[0]


def _record_base_products(engine) -> list[tuple[object, torch.Tensor, torch.Tensor, tuple | None]]:
    """Wrap every linear's base product; eager calls (not graph captures) are recorded with
    the quantized input the decoder's fused norm / SiLU-mul handed over (or None)."""
    records = []
    for _, linear in engine.model.adapter_linears():
        def recording(x, quantized=None, linear=linear, base=linear.base_product):
            y = base(x, quantized)
            if not torch.cuda.is_current_stream_capturing():
                pair = None if quantized is None else (quantized[0].clone(), quantized[1].clone())
                records.append((linear, x.clone(), y.clone(), pair))
            return y
        linear.base_product = recording
    return records


@pytest.mark.parametrize("kernel", ["weight_only", "scaled_mm", "w8a8_triton", "decode_w8a8", "decode_weight_only"])
def test_each_base_product_of_the_fp8_engine_is_its_kernels_twin(setup, kernel):
    if kernel != "weight_only" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled_mm and e4m3 tl.dot need sm_90")
    float_dir, _, lora, prompts = setup
    # every step eager (graph replays call no Python), so each prefill and decode product is seen:
    # the decode kernels take the decode steps, scaled_mm the prefills above 64 tokens. The separate
    # LoRA kernels: the fused linear (lora_decode's default on sm_90) computes its decode steps' base
    # products inside its own launch (checked against this twin in test_fp8_lora_fused_gpu.py)
    engine = _engine(float_dir, lora, device="cuda", dtype="fp8", fp8_gemm=kernel, cuda_graphs=False,
                     lora_decode="kernels")
    records = _record_base_products(engine)
    _generate(engine, prompts)
    assert len(records) >= 4 * 4 * 4  # four projections in each of four layers, prefill and 3 decode steps
    for linear, x, y, pair in records:
        ran = resolve_fp8_gemm(kernel, x.device, x.shape[0])  # the decode kernels: scaled_mm above 64 rows
        want = fp8_linear_oracle(x, linear.weight, linear.weight_scale, ran)
        assert y.dtype == torch.bfloat16 and not torch.isnan(y).any()
        rel = ((y.float() - want).norm() / want.norm()).item()
        assert rel < PROJECTION_REL_TOL, (linear.slice_kinds, tuple(x.shape), rel)
        fusable = linear.slice_kinds[0] in ("q_proj", "gate_proj", "down_proj")
        assert (pair is not None) == (fusable and ran in ACTIVATION_QUANTIZING), (linear.slice_kinds, ran)
    for linear, x, _, pair in records:  # the fused kernels' rounding is quantize_rows' bit for bit
        if pair is not None:
            q_want, scale_want = quantize_rows_reference(x)
            assert torch.equal(pair[1], scale_want), linear.slice_kinds
            assert torch.equal(pair[0].view(torch.uint8), q_want.view(torch.uint8)), linear.slice_kinds


@pytest.mark.parametrize("kernel", ["scaled_mm", "w8a8_triton", "decode_w8a8", "auto"])
def test_fused_activation_quantization_on_gpu_matches_the_unfused_engine(setup, kernel):
    """The fused norm / SiLU-mul kernels do the unfused ops' arithmetic and quantize_rows'
    rounding, so only float32 reduction order may differ (logits within FUSED_REL_TOL);
    handing a projection the rounding of another tensor moves logits by more than 0.1.
    Decode steps replay CUDA graphs captured with the fusion (warm-up) and without (lazily)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled_mm and e4m3 tl.dot need sm_90")
    float_dir, _, lora, prompts = setup
    fused = _engine(float_dir, lora, device="cuda", dtype="fp8", fp8_gemm=kernel, warmup=True)
    unfused = _engine(float_dir, lora, device="cuda", dtype="fp8", fp8_gemm=kernel)
    for _, linear in unfused.model.adapter_linears():
        linear.fuse_input_quant = False
    assert _rel(_generate(fused, prompts), _generate(unfused, prompts)) < FUSED_REL_TOL


def test_fp8_engine_on_gpu_against_float32_engines(setup):
    float_dir, dequantized, lora, prompts = setup
    want = _generate(_engine(dequantized, lora, device="cpu", dtype="float32"), prompts)
    bf16 = _rel(_generate(_engine(dequantized, lora, device="cuda", dtype="bfloat16"), prompts), want)
    weight_only = _generate(_engine(float_dir, lora, device="cuda", dtype="fp8", fp8_gemm="weight_only"), prompts)
    # weight_only differs from a bfloat16 engine on the dequantized weights only in summation order
    assert _rel(weight_only, want) < max(3 * bf16, 0.02), (_rel(weight_only, want), bf16)
    if torch.cuda.get_device_capability() < (9, 0):
        return
    scaled_mm = _generate(_engine(float_dir, lora, device="cuda", dtype="fp8", fp8_gemm="scaled_mm"), prompts)
    unquantized = _generate(_engine(float_dir, lora, device="cpu", dtype="float32"), prompts)
    assert _rel(scaled_mm, want) < SCALED_MM_REL_TOL, (_rel(scaled_mm, want), bf16)
    assert _rel(scaled_mm, unquantized) < SCALED_MM_UNQUANTIZED_REL_TOL, _rel(scaled_mm, unquantized)
    w8a8 = _generate(_engine(float_dir, lora, device="cuda", dtype="fp8", fp8_gemm="w8a8_triton"), prompts)
    assert _rel(w8a8, want) < SCALED_MM_REL_TOL, _rel(w8a8, want)  # the same arithmetic as scaled_mm
    for kernel in ("decode_w8a8", "decode_weight_only"):  # decode steps in our decode GEMM
        got = _rel(_generate(_engine(float_dir, lora, device="cuda", dtype="fp8", fp8_gemm=kernel), prompts), want)
        assert got < SCALED_MM_REL_TOL, (kernel, got)
