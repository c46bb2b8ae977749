"""The ingress's view of each call: its method, status, adapter, tenant, latency and tokens.

    call = metrics.start("Generate")     # when the call arrives (the current call from now on)
    call.tenant = tenant                 # once authenticated
    metrics.uses(version)                # the adapter version it runs with (None: the backbone)
    call.first_token(prompt_tokens)      # generation: time to first token, prompt tokens
    call.tokens(n)                       # tokens sent
    call.end("OK")                       # its status: the call's counts and latency are recorded

An HTTP stream outlives its handler: `hand_over()` makes the handler's `end` a no-op and
the stream's own end records the call. The adapter is known only once resolved: a call
refused before that (an unknown adapter) counts without one, so names no adapter has
never become label values.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.server.metrics import series as s
from adapterserve.server.metrics.recorder import BASE_TAG, NO_ADAPTER_TAG, AdapterTag
from adapterserve.server.metrics.reporter import Reporter
from adapterserve.server.metrics.scrape import Scrapes

_current: ContextVar[Call | None] = ContextVar("adapterserve_call", default=None)


class Call:
    def __init__(self, method: str, reporter: Reporter) -> None:
        self.method, self.started = method, time.monotonic()
        self.tenant: str | None = None
        self.adapter: AdapterTag = NO_ADAPTER_TAG
        self.failed_with: str | None = None  # a status seen inside a stream, which wins over the handler's
        self._reporter = reporter
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._generated = 0
        self._handed_over = self._ended = False

    def uses(self, version: AdapterVersion | None) -> None:
        self.adapter = BASE_TAG if version is None else (version.name, version.public)

    def first_token(self, prompt_tokens: int) -> None:
        now = time.monotonic()
        self._first_token_at = self._last_token_at = now
        recorder = self._reporter.recorder
        recorder.observe(s.TTFT, now - self.started, adapter=self.adapter)
        recorder.inc(s.PROMPT_TOKENS, adapter=self.adapter, amount=prompt_tokens)
        if self.tenant is not None:
            recorder.inc(s.TENANT_PROMPT_TOKENS, (self.tenant,), amount=prompt_tokens)

    def tokens(self, count: int) -> None:
        if count:
            self._generated += count
            self._last_token_at = time.monotonic()

    def hand_over(self) -> Call:
        """The call goes on in a stream after its handler returns: the stream ends it."""
        self._handed_over = True
        return self

    def end(self, code: str, *, by_stream: bool = False) -> None:
        """Record the call (once; a handed-over call only when its stream ends)."""
        if self._ended or (self._handed_over and not by_stream):
            return
        self._ended = True
        code = self.failed_with or code
        recorder, adapter = self._reporter.recorder, self.adapter
        recorder.inc(s.REQUESTS, (self.method, code), adapter)
        recorder.observe(s.REQUEST_SECONDS, time.monotonic() - self.started, (self.method,), adapter)
        recorder.inc(s.GENERATED_TOKENS, adapter=adapter, amount=self._generated)
        if self._generated > 1 and self._first_token_at is not None:
            per_token = (self._last_token_at - self._first_token_at) / (self._generated - 1)
            recorder.observe(s.TPOT, per_token, adapter=adapter)
        if self.tenant is not None:
            recorder.inc(s.TENANT_REQUESTS, (self.tenant, code))
            recorder.inc(s.TENANT_GENERATED_TOKENS, (self.tenant,), amount=self._generated)


class CallMetrics:
    """The ingress's recorder of calls, reporting to the metrics hub (`hub`: its handle; None:
    record only), and its GET /metrics (`scrapes`)."""

    def __init__(self, hub: Any | None, metrics: Mapping[str, Any]) -> None:
        self.reporter = Reporter(hub, "ingress", metrics["push_interval_s"])
        self.scrapes = Scrapes(self.reporter, hub, metrics["http_route"])

    def start(self, method: str) -> Call:
        """A call arrives: it is the current call of this task from now on."""
        self.reporter.start()
        call = Call(method, self.reporter)
        _current.set(call)
        return call

    def uses(self, version: AdapterVersion | None) -> None:
        """The current call runs with adapter `version` (None: with the backbone alone)."""
        call = _current.get()
        if call is not None:
            call.uses(version)
