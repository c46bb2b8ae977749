"""The engine's synchronous front: generate, classify and embed run a list of prompts to
completion in shared batches, stepping the engine on the caller's thread."""
from __future__ import annotations

import time
from collections.abc import Sequence

from adapterserve.engine.async_front import Prompt, per_prompt
from adapterserve.engine.request import ClassifyOutput, EmbedOutput, Request, RequestOutput
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import RequestError

_SYNC_IDLE_S = 0.001  # generate()'s pause when a step had nothing to run


class SyncFront:
    """Mixed into Engine: needs add_request, abort, step and _in_flight."""

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter_ids: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion in shared batches; outputs in prompt order (a prompt
        whose sampling has n > 1 gives its n choices, in index order)."""
        if isinstance(prompts, str):
            raise RequestError("generate takes a list of prompts; use [prompt] for one")
        n = len(prompts)
        params = per_prompt(sampling or SamplingParams(), n, "sampling")
        adapters = per_prompt(adapter_ids, n, "adapter_ids") if adapter_ids is not None else [None] * n
        requests = self._add_all([(p, s, a, "generate") for p, s, a in zip(prompts, params, adapters)])
        self._run_to_completion(requests)
        return [final_output(c) for r in requests for c in r.all_choices]  # n > 1: its n choices in index order

    def classify(self, texts: Sequence[Prompt], adapter_ids: Sequence[str] | str) -> list[ClassifyOutput]:
        """Label each text with its adapter's classification head, in shared batches."""
        return self._pool(texts, adapter_ids, "classify")

    def embed(self, texts: Sequence[Prompt], adapter_ids: Sequence[str | None] | str | None = None) -> list[EmbedOutput]:
        """Pooled hidden state of each text (last token, after the final norm)."""
        return self._pool(texts, adapter_ids, "embed")

    def _pool(self, texts, adapter_ids, task: str) -> list:
        if isinstance(texts, str):
            raise RequestError(f"{task} takes a list of texts; use [text] for one")
        ids = per_prompt(adapter_ids, len(texts), "adapter_ids")
        requests = self._add_all([(t, SamplingParams(max_tokens=1), a, task) for t, a in zip(texts, ids)])
        self._run_to_completion(requests)
        errors = [r.error for r in requests if r.error is not None]
        if errors:
            raise errors[0]
        return [r.result for r in requests]

    def _add_all(self, specs: list[tuple]) -> list[Request]:
        """add_request for each (prompt, sampling, adapter_id, task); all or none."""
        requests: list[Request] = []
        try:
            for prompt, sampling, adapter_id, task in specs:
                requests.append(self.add_request(prompt, sampling, adapter_id, task=task))
        except BaseException:
            for r in requests:
                self.abort(r.request_id)
            raise
        return requests

    def _run_to_completion(self, requests: list[Request]) -> None:
        """Step until every request has finished (aborting them if stepping raises)."""
        try:
            while any(not r.done for r in requests):
                if not self.step() and self._in_flight is None:  # nothing could run yet (adapter copies)
                    time.sleep(_SYNC_IDLE_S)
        finally:
            for r in requests:
                if not r.done:
                    self.abort(r.request_id)


def final_output(request: Request) -> RequestOutput:
    """A finished (or failed) request's whole output."""
    return RequestOutput(request.request_id, list(request.output_ids), request.text, request.finish_reason,
                         request.adapter_id, request.prompt_ids, request.error, request.cached_tokens or 0,
                         request.index)
