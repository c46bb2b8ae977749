"""Admission at one ingress replica: how many calls it holds, whether it takes another.

Every call the ingress serves (gRPC or HTTP, unary or streamed) enters through
`admit()` (or `take()`, for a place that outlives the handler: an SSE stream) and
leaves when it ends (a stream: when its last chunk is sent or its caller goes away).
A call over `max_in_flight` is shed at once with Overloaded (RESOURCE_EXHAUSTED /
429, retry advice) instead of queueing behind the others; once `drain()` is called
every new call gets ServerDraining (UNAVAILABLE / 503) while those in flight finish.
Health watches have a budget of their own, so unauthenticated watchers cannot fill
the ingress. A place may carry the call's hold on its tenant's concurrent_requests
(quotas.py), given back with it. A generation of n > 1 choices holds n places, here
and in its tenant's quota (`Place.widen`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from adapterserve.errors import Overloaded, RequestError, ServerDraining


class Releasable(Protocol):
    def release(self) -> None: ...

    def widen(self, places: int) -> None: ...


class Place:
    """One admitted call's place; given back once, by release() or when it is dropped."""

    def __init__(self, admission: Admission, hold: Releasable | None = None, places: int = 1) -> None:
        self._admission: Admission | None = admission
        self._hold = hold
        self._places = places  # counted in the admission's in_flight

    def hand_over(self) -> Place:
        """The same place as a new Place (for a stream to release when it ends); this one then
        holds nothing, so releasing it is a no-op."""
        admission, self._admission = self._admission, None
        if admission is None:
            raise RuntimeError("this admission place was already released")
        return Place(admission, self._hold, self._places)

    def widen(self, places: int) -> None:
        """Hold `places` places in all (a generation of n choices holds n), here and in the
        hold's tenant quota; raise, holding what it held, if there is no room."""
        admission, extra = self._admission, places - self._places
        if admission is None or extra <= 0:
            return
        admission.check_room(places, extra)
        if self._hold is not None:
            self._hold.widen(places)
        admission.in_flight += extra
        self._places = places

    def release(self) -> None:
        if self._admission is not None:
            self._admission.in_flight -= self._places
            self._admission = None
            if self._hold is not None:
                self._hold.release()

    def __del__(self) -> None:  # a stream whose response never started still gives its place back
        self.release()


class Admission:
    def __init__(self, max_in_flight: int, max_health_watches: int) -> None:
        self.max_in_flight = max_in_flight
        self.max_health_watches = max_health_watches
        self.in_flight = 0
        self.health_watches = 0
        self.draining = False

    def take(self, hold: Releasable | None = None) -> Place:
        """A place for one call, to release() when it ends (with `hold`); raise if there is none
        (`hold` released at once)."""
        try:
            self.check_room()
        except Exception:
            if hold is not None:
                hold.release()
            raise
        self.in_flight += 1
        return Place(self, hold)

    def check_room(self, places: int = 1, extra: int = 1) -> None:
        """Raise unless `extra` more places fit, for a call that will hold `places` in all."""
        if self.draining:
            raise ServerDraining("the server is shutting down and takes no new requests; retry on another server")
        if places > max(self.max_in_flight, 1):  # n choices that could never be admitted together
            raise RequestError(f"'n' is {places}, but this ingress replica holds at most {self.max_in_flight} "
                               f"requests (max_in_flight), each choice one: ask for n <= {self.max_in_flight}")
        if self.in_flight + extra > self.max_in_flight:
            raise Overloaded(f"the server is at capacity ({self.max_in_flight} requests in flight at this ingress "
                             "replica); retry in a moment", retry_after_s=1.0)

    @contextmanager
    def admit(self, hold: Releasable | None = None) -> Iterator[Place]:
        """Hold one place (and `hold`) for the call in the `with` body; raise if there is none."""
        place = self.take(hold)
        try:
            yield place
        finally:
            place.release()

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Hold one of the health-watch places for a grpc.health.v1 Watch stream."""
        if self.health_watches >= self.max_health_watches:
            raise Overloaded(f"{self.max_health_watches} health watches are open at this ingress replica; use "
                             "Check, or retry later", retry_after_s=5.0)
        self.health_watches += 1
        try:
            yield
        finally:
            self.health_watches -= 1

    def drain(self) -> None:
        """Refuse every new call from now on; calls in flight go on."""
        self.draining = True
