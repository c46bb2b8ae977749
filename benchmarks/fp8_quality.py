"""Quality of the FP8 backbone and, apart, of the FP8 KV cache and of the decode attention's
products in bf16: greedy agreement and logit error against bf16, with and without an adapter,
on a fixed prompt set.

    PYTHONPATH=. python benchmarks/fp8_quality.py --model /path/to/checkpoint [--adapter DIR]
    PYTHONPATH=. python benchmarks/fp8_quality.py --shape 8b      # a random-weight 8B checkpoint
    PYTHONPATH=. python benchmarks/fp8_quality.py --smoke         # CPU, tiny model, seconds

The reference engine runs bf16 (float32 on the CPU); each FP8 kernel available runs the
same prompts (fixed-seed token ids, or the fixed texts below when the checkpoint has a
tokenizer) greedily, with no adapter and with the adapter on every request (a random rank-16
LoRA on all projections, its update --adapter-gain times the base output, unless --adapter is
given); then the bf16 backbone with an FP8 KV cache (kv_cache_dtype="fp8"; on the CPU smoke:
the float32 one), then the bf16 backbone with the decode attention's products in bf16
(decode_attention_dots="input"; the reference and the other rows take float32 products), then
the yardstick: the backbone in float32 against bf16 (on the CPU: bf16 against float32), what the
reference's own rounding moves at this depth and with this adapter (--rows picks rows). Per
prompt: tokens equal until the first divergence; logits compared on the steps both runs saw the
same context (up to and including the first divergent token). Random weights give flat
logits, so their agreement is a stress figure, lower than a trained model's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from adapterserve import Engine, SamplingParams
from adapterserve.layers.base_gemm import resolve_fp8_gemm

TEXTS = (
    "The capital of France is", "def fibonacci(n):", "Translate to German: The weather is nice today.",
    "Once upon a time, in a small village by the sea,", "The three laws of thermodynamics are",
    "Q: What is 17 times 23?\nA:", "A haiku about autumn leaves:", "SELECT name, email FROM users WHERE",
    "The mitochondria is", "In 1969, the Apollo 11 mission", "To make a good cup of coffee, first",
    "The main differences between TCP and UDP are", "import numpy as np\n\ndef softmax(x):",
    "Dear hiring manager,", "The theory of general relativity states that", "List five prime numbers:",
)


# --rows: the FP8 backbone's kernels, the FP8 KV cache, "input" attention products, and the yardstick: the
# backbone in the other of float32 and bf16 (on CUDA a float32 engine against the bf16 reference, on the CPU a
# bf16 engine against the float32 one), the reference's own rounding error at this depth and adapter
ROWS = ("fp8", "kv8", "dots", "prec")
# the random LoRA's update is this fraction of each projection's base output: a trained adapter's order. At
# 2.0 (B unscaled) it outweighs the backbone, and on a random 1B even bf16's own rounding changed nearly every
# greedy token with it (BENCHMARKS.md, twenty-sixth session)
ADAPTER_GAIN = 0.1


def _prompts(engine: Engine, count: int, vocab: int) -> list:
    if engine.tokenizer is not None:
        return list(TEXTS[:count])
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(16, 512, (count,), generator=g)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def _run(engine: Engine, prompts: list, adapter: str | None, max_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and [steps, V] float32 logits per prompt."""
    captured: dict[str, list[torch.Tensor]] = {}
    run = engine.runner.run

    def recording(batch, generators):
        rows = [r for r in engine.runner.completing(batch) if not r.pooling]
        tokens = run(batch, generators)
        for row, request in enumerate(rows):
            captured.setdefault(request.request_id, []).append(engine.runner.last_logits[row].float().cpu())
        return tokens

    engine.runner.run = recording
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, greedy, adapter_ids=[adapter] * len(prompts))
    engine.runner.run = run
    return [(o.token_ids, torch.stack(captured[o.request_id][: len(o.token_ids)])) for o in outs]


def _compare(ref, got) -> dict:
    agreed, max_abs, max_rel = [], 0.0, 0.0
    for (ref_ids, ref_logits), (ids, logits) in zip(ref, got):
        same = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), len(ref_ids))
        agreed.append(same)
        steps = min(same + 1, len(ref_ids))
        diff = logits[:steps] - ref_logits[:steps]
        max_abs = max(max_abs, diff.abs().max().item())
        max_rel = max(max_rel, (diff.norm(dim=1) / ref_logits[:steps].norm(dim=1)).max().item())
    n = len(ref[0][0])
    return {"mean agreed": statistics.mean(agreed), "min agreed": min(agreed),
            "all agree": sum(a == n for a in agreed) / len(agreed), "max abs dlogit": max_abs, "max rel L2": max_rel}


def _engine(path: Path, device: str, dtype: str, adapter_dir: Path, fp8_gemm: str = "auto",
            kv_cache_dtype: str = "auto", dots: str = "float32") -> Engine:
    # no warm-up: quality is not timed, and an 8B engine's warm-up costs minutes (BENCHMARKS.md); its
    # kernels compile and its graphs are captured on first use instead
    engine = Engine.from_pretrained(path, device=device, dtype=dtype, fp8_gemm=fp8_gemm, max_loras=1,
                                    max_lora_rank=64, num_kv_blocks=2048, block_size=16, cuda_graphs=device == "cuda",
                                    kv_cache_dtype=kv_cache_dtype, decode_attention_dots=dots, warmup=False)
    engine.load_adapter("adapter", adapter_dir)
    return engine


def _checkpoint(args, tmp: Path, device: str) -> tuple[Path, Path]:
    from benchmarks.checkpoints import SHAPES, write_random_checkpoint
    from benchmarks.random_adapters import write_peft_lora

    shape = SHAPES["tiny" if args.smoke else args.shape]
    model = Path(args.model) if args.model else write_random_checkpoint(shape, tmp / "model", device)
    adapter = (Path(args.adapter) if args.adapter
               else write_peft_lora(shape, tmp / "lora", device, gain=args.adapter_gain))
    return model, adapter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: a random one of --shape)")
    p.add_argument("--shape", default="8b", help="random checkpoint shape when --model is not given: 1b or 8b")
    p.add_argument("--adapter", help="PEFT LoRA directory for the model (default: random rank 16)")
    p.add_argument("--adapter-gain", type=float, default=ADAPTER_GAIN,
                   help="the random LoRA's update against the base output, as norms (default %(default)s)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 4 prompts, 6 tokens")
    p.add_argument("--rows", default=",".join(ROWS), help=f"which rows, comma-separated: {', '.join(ROWS)}")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.prompts, args.max_tokens = 4, 6
    elif device != "cuda":
        sys.exit("no CUDA device: run on a GPU, or pass --smoke")
    tmp = Path(tempfile.mkdtemp(prefix="fp8q-"))
    try:
        model, adapter = _checkpoint(args, tmp, device)
        _print_header(device, model, args)
        _measure(model, adapter, device, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(model: Path, adapter: Path, device: str, args) -> None:
    """Each row printed as it is measured (a run cut short keeps the rows it finished)."""
    ref_dtype = "bfloat16" if device == "cuda" else "float32"
    engine = _engine(model, device, ref_dtype, adapter)
    prompts = _prompts(engine, args.prompts, engine.model_config.vocab_size)
    refs = {a: _run(engine, prompts, a, args.max_tokens) for a in (None, "adapter")}
    del engine
    for label, build in _candidates(model, adapter, device, ref_dtype, args.rows.split(",")):
        engine = build()
        for a in (None, "adapter"):
            _print_row(label, a or "none", _compare(refs[a], _run(engine, prompts, a, args.max_tokens)))
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()


def _candidates(model: Path, adapter: Path, device: str, ref_dtype: str, wanted: list[str]) -> list:
    """(label, engine builder) of each row asked for: the FP8 kernels, the FP8 KV cache, the
    decode attention's products in the activations' dtype (decode_attention_dots="input")."""
    unknown = set(wanted) - set(ROWS)
    if unknown:
        sys.exit(f"unknown rows {sorted(unknown)}: pick from {', '.join(ROWS)}")
    engines = []
    if "fp8" in wanted:
        kernels = dict.fromkeys(resolve_fp8_gemm(k, torch.device(device)) for k in ("scaled_mm", "weight_only"))
        if device == "cuda" and torch.cuda.get_device_capability() < (9, 0):
            kernels.pop("scaled_mm", None)
        engines += [(kernel, lambda kernel=kernel: _engine(model, device, "fp8", adapter, kernel)) for kernel in kernels]
    if "kv8" in wanted:
        engines.append((f"{ref_dtype} weights, fp8 KV cache",
                        lambda: _engine(model, device, ref_dtype, adapter, kv_cache_dtype="fp8")))
    if "dots" in wanted:
        engines.append((f"{ref_dtype} weights, attention products in {ref_dtype}",
                        lambda: _engine(model, device, ref_dtype, adapter, dots="input")))
    if "prec" in wanted:
        other = "float32" if ref_dtype == "bfloat16" else "bfloat16"
        engines.append((f"{other} weights (the reference's rounding)", lambda: _engine(model, device, other, adapter)))
    return engines


def _print_header(device: str, model: Path, args) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke: float32 against fp8 on CPU: scaled_mm emulated in float32, weight_only dequantized)"
    source = model if args.model else f"random-weight {'tiny' if args.smoke else args.shape} checkpoint"
    source += f"; adapter {args.adapter}" if args.adapter else f"; random LoRA at gain {args.adapter_gain}"
    print(f"\n{name}; torch {torch.__version__}; {source}; {args.prompts} prompts x {args.max_tokens} greedy tokens; "
          f"fp8 (e4m3 weights, per-channel scales) against {'bf16' if device == 'cuda' else 'float32'}")
    cols = ["mean agreed", "min agreed", "all agree", "max abs dlogit", "max rel L2"]
    print("| variant (fp8 kernel, KV cache, attention products) | adapter | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 2), flush=True)


def _print_row(kernel: str, adapter: str, m: dict) -> None:
    print(f"| {kernel} | {adapter} | {m['mean agreed']:.1f} | {m['min agreed']} | {100 * m['all agree']:.0f}% | "
          f"{m['max abs dlogit']:.3f} | {m['max rel L2']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
