"""Chunk pacing: one stream is never delayed; the pause grows with the streams running."""
import pytest

from adapterserve.server.relay import RelayPacer


def test_one_stream_is_never_paused_and_many_share_the_chunk_rate():
    pacer = RelayPacer(0.0005)
    with pacer.stream():
        assert pacer.pause_s() == 0
        with pacer.stream(), pacer.stream(), pacer.stream():
            assert pacer.pause_s() == pytest.approx(3 * 0.0005)
        assert pacer.streams == 1
    assert pacer.streams == 0


def test_a_stream_that_fails_is_no_longer_counted():
    pacer = RelayPacer(0.001)
    with pytest.raises(RuntimeError), pacer.stream():
        raise RuntimeError("caller went away")
    assert pacer.streams == 0 and pacer.pause_s() == 0


def test_zero_turns_pacing_off_and_negative_is_refused():
    pacer = RelayPacer(0.0)
    with pacer.stream(), pacer.stream():
        assert pacer.pause_s() == 0
    with pytest.raises(ValueError, match="relay chunk cost"):
        RelayPacer(-1.0)

