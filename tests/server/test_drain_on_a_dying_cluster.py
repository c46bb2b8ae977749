"""A drain that fails while Ray's own processes exit (the stop signal reached them too) is not
an error: the server stops with Ray gone. A drain that fails while Ray stays up is one."""
from __future__ import annotations

import time

import pytest

from adapterserve.server import serve_command


class DyingRay:
    """launch's drain and ray_lost: the drain fails at once, as Serve's KV store does when the
    GCS cancels its calls; the GCS process exits `exits_after_s` later (None: never)."""

    def __init__(self, exits_after_s: float | None) -> None:
        self.started = time.monotonic()
        self.exits_after_s = exits_after_s

    def drain(self, config: object, grace_s: float) -> int:
        raise RuntimeError("KVStoreError: 1 (the GCS cancelled the call)")

    def ray_lost(self) -> bool:
        return self.exits_after_s is not None and time.monotonic() - self.started >= self.exits_after_s


@pytest.fixture
def dying(monkeypatch: pytest.MonkeyPatch):
    def install(exits_after_s: float | None) -> DyingRay:
        ray = DyingRay(exits_after_s)
        monkeypatch.setattr(serve_command.launch, "drain", ray.drain)
        monkeypatch.setattr(serve_command.launch, "ray_lost", ray.ray_lost)
        monkeypatch.setattr(serve_command, "RAY_EXIT_WAIT_S", 3.0)
        return ray
    return install


def test_a_drain_failing_as_the_gcs_exits_means_ray_is_gone(dying):
    dying(exits_after_s=0.5)
    assert serve_command._drain({}, grace_s=30.0) is None


def test_a_drain_failing_with_ray_up_is_raised(dying):
    dying(exits_after_s=None)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="KVStoreError"):
        serve_command._drain({}, grace_s=30.0)
    assert time.monotonic() - started >= 3.0, "it waited for Ray to go down before calling it a fault"


def test_ray_going_down_is_seen_at_once_when_already_lost(dying):
    dying(exits_after_s=0.0)
    started = time.monotonic()
    assert serve_command.ray_going_down(10.0)
    assert time.monotonic() - started < 1.0
