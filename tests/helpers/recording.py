"""Capture the logits an engine samples from, per request and step (for comparing
against a reference run)."""
from __future__ import annotations

import torch


def record_logits(engine) -> dict[str, list[torch.Tensor]]:
    """Wrap engine.runner.run; returns request id -> [float32 CPU logits of each step that
    samples it] (the rows of last_logits: generating requests whose tokens the step completes,
    not a prefill chunk short of its prompt's end). Steps overlap, so a request a stop token
    ended has one more, discarded, entry."""
    captured: dict[str, list[torch.Tensor]] = {}
    run = engine.runner.run

    def recording_run(batch, generators):
        rows = [r for r in engine.runner.completing(batch) if not r.pooling]  # before run moves them on
        tokens = run(batch, generators)
        for row, request in enumerate(rows):
            logits = engine.runner.last_logits[row].float().cpu().clone()  # a graph's buffer is rewritten
            captured.setdefault(request.request_id, []).append(logits)
        return tokens

    engine.runner.run = recording_run
    return captured


def greedy_run(engine, prompts: list, adapter_ids: list, max_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt, run greedily (ignore_eos) with its adapter: (tokens, [max_tokens, V] float32
    logits of the steps that sampled them: the prefill, then the decodes)."""
    from adapterserve import SamplingParams

    captured = record_logits(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params, adapter_ids=adapter_ids)
    return [(o.token_ids, torch.stack(captured[o.request_id][:max_tokens])) for o in outs]


def greedy_logits_error(got, want) -> tuple[float, int]:
    """(largest relative L2 error, steps compared) of two runs' per-prompt (greedy tokens,
    per-step logits), over the steps whose context (the greedy tokens before them) is the
    same in both."""
    errors = []
    for (got_tokens, got_logits), (want_tokens, want_logits) in zip(got, want):
        for step in range(min(len(got_logits), len(want_logits))):
            if got_tokens[:step] != want_tokens[:step]:
                break
            errors.append(((got_logits[step] - want_logits[step]).norm() / want_logits[step].norm()).item())
    return max(errors), len(errors)
