"""An EncoderEngine's calls in progress, for health.

An EncoderEngine runs each classify/embed call at once, in a worker thread, with no
queue; so its time without progress is the age of its oldest running call. A call
that fails with an accelerator error (a CUDA error poisons the device context of the
process) breaks it: later calls get EngineBroken until the engine process is replaced.
Any other error ends its own call only.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from adapterserve.errors import EngineBroken


class EncoderCalls:
    def __init__(self) -> None:
        self.broken: str | None = None  # why the encoder serves no more calls
        self._started: dict[int, float] = {}  # call -> time.monotonic() it started
        self._ids = itertools.count()

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` in a worker thread, timed while it runs."""
        if self.broken is not None:
            raise EngineBroken(f"the encoder is broken ({self.broken}) and serves no more requests; retry")
        key = next(self._ids)
        self._started[key] = time.monotonic()
        try:
            return await asyncio.to_thread(call, *args)
        except Exception as exc:
            if not _on_the_device(exc):
                raise
            self.broken = f"{type(exc).__name__}: {exc}"
            raise EngineBroken(f"the encoder failed a call on its device and serves no more requests "
                               f"({self.broken}); retry: its engine is being restarted") from exc
        finally:
            del self._started[key]

    @property
    def running(self) -> int:
        """Calls running now."""
        return len(self._started)

    def busy_s(self) -> float:
        """How long the oldest running call has run (0.0 when none runs)."""
        started = list(self._started.values())
        return time.monotonic() - min(started) if started else 0.0


def _on_the_device(exc: Exception) -> bool:
    """Whether exc is an accelerator error (torch is loaded: the encoder runs in this process)."""
    import torch

    return isinstance(exc, torch.AcceleratorError)
