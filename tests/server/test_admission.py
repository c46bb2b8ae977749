"""Admission at one ingress replica: places up to max_in_flight (the rest shed with retry
advice), a place handed over to a stream, health watches counted apart, draining."""
from __future__ import annotations

import gc

import pytest

from adapterserve.errors import Overloaded, ServerDraining
from adapterserve.server.admission import Admission


def test_calls_over_max_in_flight_are_shed_with_retry_advice():
    admission = Admission(max_in_flight=2, max_health_watches=1)
    with admission.admit(), admission.admit():
        with pytest.raises(Overloaded, match="at capacity \\(2 requests in flight") as shed:
            admission.take()
        assert shed.value.retry_after_s == 1.0 and admission.in_flight == 2
    assert admission.in_flight == 0
    with admission.admit():
        pass


def test_a_place_is_given_back_once_however_it_ends():
    admission = Admission(max_in_flight=1, max_health_watches=1)
    place = admission.take()
    stream_place = place.hand_over()  # a stream takes it over
    place.release()  # the handler's own release: nothing left to give
    assert admission.in_flight == 1
    stream_place.release()
    stream_place.release()
    assert admission.in_flight == 0
    with pytest.raises(RuntimeError, match="already released"):
        place.hand_over()
    admission.take().hand_over()  # a stream whose response never started: dropped, not released
    gc.collect()
    assert admission.in_flight == 0


def test_health_watches_have_their_own_budget():
    admission = Admission(max_in_flight=1, max_health_watches=2)
    with admission.watch(), admission.watch():
        with pytest.raises(Overloaded, match="2 health watches are open") as refused:
            admission.watch().__enter__()
        assert refused.value.retry_after_s == 5.0
        with admission.admit():  # watches never take a call's place
            pass
    assert admission.health_watches == 0


def test_draining_refuses_new_calls_while_those_in_flight_go_on():
    admission = Admission(max_in_flight=4, max_health_watches=1)
    with admission.admit():
        admission.drain()
        with pytest.raises(ServerDraining, match="shutting down"):
            admission.take()
        assert admission.in_flight == 1
    assert admission.in_flight == 0
