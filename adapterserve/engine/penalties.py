"""Logit bias and the penalties that depend on the tokens a request has seen.

Each request with penalties owns a row of device tables kept across steps: how often
each token is among its outputs (`counts`), which tokens its prompt holds
(`in_prompt`), and its three penalties. The row is filled at the request's first
sampled token, and every later sampled token is counted on the device right after it
is drawn: the newest token counts at once, although the host sees it a step later
(overlapped steps). Each request with a logit bias owns a row of (token, bias)
entries, padded with (0, 0.0). So a step costs the host one small copy of row
indices, whatever the requests have seen. A batch without bias or penalties skips
all of this.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adapterserve.engine.host_copy import to_device
from adapterserve.engine.request import Request
from adapterserve.engine.request_tables import RequestTables
from adapterserve.engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES
from adapterserve.kernels import ops

_PENALTIES = ("repetition", "frequency", "presence")


@dataclass
class StepPenalties:
    """What one step's sampler applies; row indices on the device, the tables themselves."""

    bias_rows: torch.Tensor | None = None  # [Rb] long: logits rows with a bias
    bias_table_rows: torch.Tensor | None = None  # [Rb] long: their rows of `bias`
    bias: RequestTables | None = None  # tokens [N, 300] long, values [N, 300] float32
    rows: torch.Tensor | None = None  # [R] long: logits rows with penalties
    table_rows: torch.Tensor | None = None  # [R] long: their rows of `penalties`
    penalties: RequestTables | None = None  # counts [N, V] int32, in_prompt [N, V] bool, params [N, 3] float32
    in_use: tuple[bool, bool, bool] = (False, False, False)  # repetition, frequency, presence: any row


def apply_penalties(logits: torch.Tensor, step: StepPenalties) -> torch.Tensor:
    """logits [G, V] float32 -> a new tensor: bias added, then each penalised row's
    repetition, frequency and presence penalties (the order of Hugging Face and vLLM)."""
    out = logits.clone()
    if step.bias_rows is not None:
        tokens = step.bias["tokens"].index_select(0, step.bias_table_rows)  # [Rb, 300], padded with 0
        values = step.bias["values"].index_select(0, step.bias_table_rows)  # padded with 0.0
        flat = (step.bias_rows.unsqueeze(1) * out.shape[1] + tokens).view(-1)
        out.view(-1).index_add_(0, flat, values.view(-1))  # adding the padding's 0.0 changes nothing
    if step.rows is not None:
        tables = step.penalties
        penalised = torch.empty(step.rows.shape[0], out.shape[1], dtype=out.dtype, device=out.device)
        ops.penalise_rows(out, step.rows, step.table_rows, tables["counts"], tables["in_prompt"], tables["params"],
                          step.in_use, penalised)  # one pass per row (Triton on a GPU)
        out.index_copy_(0, step.rows, penalised)
    return out


class PenaltyState:
    """Per-request bias and penalty tables on the device, for a vocabulary of vocab_size tokens."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.penalties = RequestTables(device, {
            "counts": ((vocab_size,), torch.int32), "in_prompt": ((vocab_size,), torch.bool),
            "params": ((len(_PENALTIES),), torch.float32)})
        self.bias = RequestTables(device, {"tokens": ((MAX_LOGIT_BIAS_ENTRIES,), torch.long),
                                           "values": ((MAX_LOGIT_BIAS_ENTRIES,), torch.float32)})
        self._ones = torch.ones(0, dtype=torch.int32, device=device)  # what record adds, grown as needed

    def prepare(self, requests: list[Request]) -> StepPenalties | None:
        """The bias and penalties of a step whose generating requests are `requests` (in
        logits order); None when none of them has any."""
        for tables in (self.penalties, self.bias):
            if tables.rows:
                tables.release_finished()
        biased, penalised = [], []
        for i, request in enumerate(requests):
            sampling = request.sampling
            if sampling.logit_bias:
                biased.append(i)
            if sampling.penalised:
                penalised.append(i)
        if not biased and not penalised:
            return None
        self._admit_bias([requests[i] for i in biased if requests[i] not in self.bias.rows])
        self._admit_penalties([requests[i] for i in penalised if requests[i] not in self.penalties.rows])
        # one copy: [2, W], penalised rows first. Their count and W are padded to even, so the
        # rows the penalty kernel reads start 16-byte aligned whatever the counts (Triton
        # compiles a variant per pointer alignment: this keeps one, the one warm-up compiles).
        r, b = len(penalised), len(biased)
        p = r + r % 2
        width = p + b + (p + b) % 2
        rows = _padded(penalised, p) + _padded(biased, width - p)
        table_rows = (_padded([self.penalties.rows[requests[i]] for i in penalised], p)
                      + _padded([self.bias.rows[requests[i]] for i in biased], width - p))
        index = to_device([rows, table_rows], self.device, torch.long)
        step = StepPenalties()
        if biased:
            step.bias_rows, step.bias_table_rows, step.bias = index[0, p : p + b], index[1, p : p + b], self.bias
        if penalised:
            step.rows, step.table_rows, step.penalties = index[0, :r], index[1, :r], self.penalties
            params = [requests[i].sampling for i in penalised]
            step.in_use = (any(s.repetition_penalty != 1.0 for s in params), any(s.frequency_penalty for s in params),
                           any(s.presence_penalty for s in params))
        return step

    def record(self, step: StepPenalties | None, tokens: torch.Tensor) -> None:
        """Count this step's sampled tokens ([G] long, on the device) in their rows."""
        if step is None or step.rows is None:
            return
        counts = self.penalties["counts"]
        flat = step.table_rows * counts.shape[1] + tokens.index_select(0, step.rows)
        if self._ones.shape[0] < flat.shape[0]:
            self._ones = torch.ones(2 * flat.shape[0], dtype=torch.int32, device=self.device)
        counts.view(-1).index_add_(0, flat, self._ones[:flat.shape[0]])

    def _admit_bias(self, requests: list[Request]) -> None:
        if not requests:
            return
        rows = to_device(self.bias.assign(requests), self.device, torch.long)
        tokens = np.zeros((len(requests), MAX_LOGIT_BIAS_ENTRIES), dtype=np.int64)
        values = np.zeros((len(requests), MAX_LOGIT_BIAS_ENTRIES), dtype=np.float32)
        for i, r in enumerate(requests):
            entries = r.sampling.logit_bias
            tokens[i, :len(entries)] = [t for t, _ in entries]
            values[i, :len(entries)] = [v for _, v in entries]
        self.bias["tokens"].index_copy_(0, rows, to_device(tokens, self.device))
        self.bias["values"].index_copy_(0, rows, to_device(values, self.device))

    def _admit_penalties(self, requests: list[Request]) -> None:
        """Zeroed counts, the prompt's tokens marked (repetition penalty only), the penalties."""
        if not requests:
            return
        table_rows = self.penalties.assign(requests)
        rows = to_device(table_rows, self.device, torch.long)
        self.penalties["counts"].index_fill_(0, rows, 0)
        self.penalties["in_prompt"].index_fill_(0, rows, False)
        params = np.array([[getattr(r.sampling, f"{name}_penalty") for name in _PENALTIES] for r in requests],
                          dtype=np.float32)
        self.penalties["params"].index_copy_(0, rows, to_device(params, self.device))
        prompts = [(row, r.prompt_ids) for row, r in zip(table_rows, requests) if r.sampling.repetition_penalty != 1.0]
        if prompts:
            prompt_rows = np.repeat([row for row, _ in prompts], [len(ids) for _, ids in prompts])
            tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in prompts])
            index = (to_device(prompt_rows, self.device, torch.long), to_device(tokens, self.device, torch.long))
            self.penalties["in_prompt"].index_put_(index, torch.ones((), dtype=torch.bool, device=self.device))


def _padded(values: list[int], length: int) -> list[int]:
    return values + [0] * (length - len(values))
