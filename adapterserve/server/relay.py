"""Pacing of streamed chunks through Ray Serve.

Every chunk a replica yields costs a fixed amount of work, whatever it carries (the Serve
path replica -> ingress; in direct mode mostly the gRPC message to the client), so many
streams at one chunk per decode step overrun it (BENCHMARKS.md, the server path). A paced
stream waits (streams - 1) x chunk_cost_s after each chunk it relays, then takes every
token that arrived meanwhile as one merged chunk (the engine's streams merge what waited:
`pause_s` of Engine.stream). One stream alone is never delayed; many together share a
bounded chunk rate of about 1 / chunk_cost_s per replica, and carry several tokens per
chunk. A finishing token ends the wait (engine/output_queue.py), so pacing never delays a
request's end.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class RelayPacer:
    def __init__(self, chunk_cost_s: float) -> None:
        if chunk_cost_s < 0:
            raise ValueError(f"relay chunk cost must be >= 0, got {chunk_cost_s}")
        self.chunk_cost_s = chunk_cost_s
        self.streams = 0  # streams relaying now

    @contextmanager
    def stream(self) -> Iterator[None]:
        """Counts one relaying stream for as long as the block runs."""
        self.streams += 1
        try:
            yield
        finally:
            self.streams -= 1

    def pause_s(self) -> float:
        """How long a stream waits after relaying a chunk, with this many streams running."""
        return max(0, self.streams - 1) * self.chunk_cost_s
