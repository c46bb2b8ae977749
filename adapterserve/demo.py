"""Engine demo on the embedded default: a tiny random-weight Llama written locally,
three PEFT LoRA adapters made with peft, and one mixed batch.

    python -m adapterserve.demo [--workdir DIR]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from adapterserve import Engine, SamplingParams
from adapterserve.models.tiny import write_tiny_checkpoint

ADAPTERS = {  # id -> (rank, alpha, target modules)
    "summarize": (8, 16, ["q_proj", "v_proj"]),
    "translate": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "sql": (4, 8, ["gate_proj", "up_proj", "down_proj"]),
}


def make_lora(base_dir: Path, out_dir: Path, rank: int, alpha: int, targets: list[str], seed: int) -> Path:
    """A random PEFT LoRA adapter (B non-zero so it changes the output), saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and adapters are written")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="adapterserve-demo-"))
    model_dir = write_tiny_checkpoint(workdir / "tiny-llama", "llama")
    engine = Engine.from_pretrained(model_dir, device="cpu", dtype="float32", max_lora_rank=64)
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        engine.load_adapter(name, make_lora(model_dir, workdir / name, rank, alpha, targets, seed))
    prompts = ["The river runs", "The river runs", "The river runs", "The river runs", "Hikers follow"]
    adapter_ids = [None, "summarize", "translate", "sql", "sql"]
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), adapter_ids=adapter_ids)
    elapsed = time.perf_counter() - start
    print(f"backbone: {model_dir} (random weights: the text is noise, the mechanics are real)")
    print(f"{len(prompts)} requests, {len(ADAPTERS)} adapters + base, one batch, {elapsed:.2f} s\n")
    for prompt, adapter, out in zip(prompts, adapter_ids, outs):
        print(f"[{adapter or 'base':>9}] {prompt!r} -> {out.text!r}")
        print(f"{'':12}tokens={out.token_ids} finish={out.finish_reason}")


if __name__ == "__main__":
    main()
