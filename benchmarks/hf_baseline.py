"""Hugging Face baselines on the same checkpoint and prompts: transformers alone,
and transformers + PEFT with one LoRA per request in a mixed batch (adapter_names).

Both run one prefill (left-padded batch, logits of the last position only) and
then a greedy decode loop over the model's own KV cache (DynamicCache, as
``generate`` uses), timing every decode step with a device synchronise. They are
slow, so only a few decode steps run.
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.checkpoints import LINEARS
from benchmarks.measure import sync


def load_hf(model_dir, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map=device).eval()


def add_peft_loras(model, count: int, rank: int = 16, log=print):
    """Wrap ``model`` in a PeftModel holding ``count`` random LoRAs a0..a{count-1},
    all seven projections, kept in the model's dtype (no float32 upcast).
    PEFT's add_adapter walks every module of the model each time: quadratic in count."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LINEARS), init_lora_weights=False,
                        task_type="CAUSAL_LM")
    start = time.perf_counter()
    peft_model = get_peft_model(model, config, adapter_name="a0", autocast_adapter_dtype=False)
    for i in range(1, count):
        peft_model.add_adapter(f"a{i}", config, autocast_adapter_dtype=False)
        if (i + 1) % 16 == 0:
            log(f"  {i + 1}/{count} PEFT adapters added ({time.perf_counter() - start:.0f} s)")
    return peft_model.eval()


def left_pad(prompts: list[list[int]], device: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def decode_loop(model, prompts: list[list[int]], steps: int, device: str, **extra) -> tuple[float, list[float]]:
    """Seconds of the prefill (to the first token) and of each greedy decode step."""
    ids, mask = left_pad(prompts, device)
    sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1, **extra)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    prefill = time.perf_counter() - start
    ones = torch.ones_like(token)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mask = torch.cat([mask, ones], dim=1)
        out = model(input_ids=token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                    past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1, **extra)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return prefill, times


def timed_row(model, prompts: list[list[int]], steps: int, device: str, **extra) -> dict:
    """Warm up on two short prompts, then time the batch."""
    short = [p[:16] for p in prompts[:2]]
    warm_extra = {k: v[:2] for k, v in extra.items()}
    decode_loop(model, short, 2, device, **warm_extra)
    prefill, times = decode_loop(model, prompts, steps, device, **extra)
    step = statistics.median(times)
    batch = len(prompts)
    return {
        "decode_ms": 1e3 * step, "decode_tok_s": batch / step, "decode_batch": batch,
        "ttft_ms": 1e3 * prefill, "run_tok_s": batch * (1 + steps) / (prefill + sum(times)),
        "tokens": batch * (1 + steps), "wall_s": prefill + sum(times), "decode_steps": steps,
        "step_ms_all": [1e3 * t for t in times], "note": f"{steps} decode steps",
    }
