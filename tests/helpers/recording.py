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
