"""Per-tenant concurrent requests and tokens per minute, counted at one ingress replica.

`enter(caller, call)` takes a place for one call of a tenant, or raises QuotaExceeded
(RESOURCE_EXHAUSTED / 429) naming the quota, its limit, the usage and when to retry. A
generation of n > 1 choices widens its hold to n places (each choice is a sequence).
tokens_per_minute is a sliding window over the last 60 s, kept in one-second buckets:
prompt and generated tokens of generation calls count as they stream; a call is
refused while the window holds the limit or more (the call that crosses it finishes).

With several ingress replicas each one enforces its share of a quota: the limit divided
by the number of replicas, rounded up (Serve spreads calls evenly over them).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from adapterserve.adapters_store.tenants import TOKEN_CALLS, Caller
from adapterserve.errors import QuotaExceeded, RequestError
from adapterserve.server.metrics import series

WINDOW_S = 60


class Hold:
    """One call's places in its tenant's concurrent_requests (one, or n for n choices); released once."""

    def __init__(self, gate: TenantGate | None, tenant: str | None, quota: int | None = None) -> None:
        self._gate, self._tenant, self._quota = gate, tenant, quota
        self._places = 1

    def widen(self, places: int) -> None:
        """Hold `places` places in all (a generation of n choices: n); RequestError if the quota can
        never hold that many, QuotaExceeded if it cannot now (holding what it held)."""
        if self._gate is None or places <= self._places:
            return
        self._gate._widen(self._tenant, self._quota, places - self._places, places)
        self._places = places

    def release(self) -> None:
        if self._gate is not None:
            self._gate._leave(self._tenant, self._places)
            self._gate = None


class TokenWindow:
    """Tokens counted in one-second buckets over the last WINDOW_S seconds."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [second, tokens], oldest first

    def add(self, tokens: int) -> None:
        second = int(self._clock())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([second, tokens])
        self._expire(second)

    def total(self) -> int:
        self._expire(int(self._clock()))
        return sum(tokens for _, tokens in self._buckets)

    def seconds_until_below(self, limit: int) -> float:
        """Whole seconds (at least 1) until the window holds fewer than `limit` tokens, if no more
        arrive."""
        now, total, wait = self._clock(), self.total(), 1.0
        for second, tokens in self._buckets:
            if total < limit:
                break
            total -= tokens
            wait = max(wait, float(math.ceil(second + WINDOW_S - now)))  # the bucket drops out then
        return wait

    def _expire(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - WINDOW_S:
            self._buckets.popleft()


@dataclass
class _TenantState:
    in_flight: int
    window: TokenWindow


class TenantGate:
    def __init__(self, replicas: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.replicas = max(1, replicas)
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}

    def enter(self, caller: Caller, call: str) -> Hold:
        """A place for `call` of `caller`'s tenant (a no-op hold for tenant None)."""
        if caller.tenant is None:
            return Hold(None, None)
        state = self._state(caller.tenant)
        quotas = caller.quotas
        if call in TOKEN_CALLS and quotas.tokens_per_minute is not None:
            self._check_tokens(caller.tenant, state, quotas.tokens_per_minute)
        if quotas.concurrent_requests is not None:
            share = self.share(quotas.concurrent_requests)
            if state.in_flight >= share:
                raise QuotaExceeded(f"tenant {caller.tenant}: concurrent_requests {quotas.concurrent_requests} "
                                    f"reached ({state.in_flight} in flight{self._where(share)}); retry when one "
                                    "ends", "concurrent_requests", retry_after_s=1.0)
        state.in_flight += 1
        return Hold(self, caller.tenant, quotas.concurrent_requests)

    def count_tokens(self, tenant: str | None, tokens: int) -> None:
        if tenant is not None and tokens > 0:
            self._state(tenant).window.add(tokens)

    def usage(self, tenant: str | None) -> tuple[int, int]:
        """(calls in flight, tokens in the last 60 s) of `tenant` at this replica."""
        state = self._tenants.get(tenant) if tenant is not None else None
        return (state.in_flight, state.window.total()) if state else (0, 0)

    def share(self, limit: int) -> int:
        """This replica's part of a tenant-wide `limit`."""
        return max(1, math.ceil(limit / self.replicas))

    def _check_tokens(self, tenant: str, state: _TenantState, limit: int) -> None:
        share, used = self.share(limit), state.window.total()
        if used >= share:
            after = state.window.seconds_until_below(share)
            raise QuotaExceeded(f"tenant {tenant}: tokens_per_minute {limit} reached ({used} in the last "
                                f"{WINDOW_S} s{self._where(share)}); retry after {after:g} s", "tokens_per_minute",
                                retry_after_s=after)

    def _where(self, share: int) -> str:
        return "" if self.replicas == 1 else f" at this ingress replica, whose share is {share}"

    def _state(self, tenant: str) -> _TenantState:
        if tenant not in self._tenants:
            self._tenants[tenant] = _TenantState(0, TokenWindow(self._clock))
        return self._tenants[tenant]

    def _widen(self, tenant: str, quota: int | None, extra: int, places: int) -> None:
        state = self._state(tenant)
        if quota is not None:
            share = self.share(quota)
            if places > share:
                raise RequestError(f"'n' is {places}, but tenant {tenant} may run {share} requests at once "
                                   f"(concurrent_requests {quota}{self._where(share)}), each choice one: ask for "
                                   f"n <= {share}")
            if state.in_flight + extra > share:
                raise QuotaExceeded(f"tenant {tenant}: concurrent_requests {quota} reached ({state.in_flight} in "
                                    f"flight{self._where(share)}, {places} more wanted for n={places}); retry when "
                                    "some end", "concurrent_requests", retry_after_s=1.0)
        state.in_flight += extra

    def _leave(self, tenant: str | None, places: int = 1) -> None:
        if tenant is not None and tenant in self._tenants:
            self._tenants[tenant].in_flight -= places


def count_refusal(metrics, tenant: str | None, exc: BaseException) -> None:
    """Count `exc` in adapterserve_tenant_quota_refusals if it is a tenant's quota refusal
    (`metrics`: the ingress's CallMetrics)."""
    if isinstance(exc, QuotaExceeded) and tenant is not None:
        metrics.reporter.recorder.inc(series.TENANT_QUOTA_REFUSALS, (tenant, exc.quota))
