"""stream_chunk: a streamed chunk built without RequestOutput's __init__ is the same value,
field for field, as one built through it, and stays frozen and picklable."""
import dataclasses
import pickle

import pytest

from adapterserve.engine.request import Request, RequestOutput, stream_chunk
from adapterserve.engine.sampling_params import SamplingParams


def _request() -> Request:
    request = Request(prompt_ids=[3, 4, 5], sampling=SamplingParams(max_tokens=4), adapter_id="sql",
                      request_id="r-7", index=2)
    request.finish_reason, request.cached_tokens = "length", 16
    return request


def test_chunk_equals_one_built_through_init():
    request = _request()
    chunk = stream_chunk(request, [9, 10], "hi")
    built = RequestOutput(request.request_id, [9, 10], "hi", "length", "sql", [3, 4, 5], None, 16, 2)
    assert chunk == built
    assert {f.name: getattr(chunk, f.name) for f in dataclasses.fields(RequestOutput)} == dataclasses.asdict(built)
    assert chunk.finished and pickle.loads(pickle.dumps(chunk)) == built


def test_chunk_of_a_request_never_cached_counts_zero_and_is_frozen():
    request = _request()
    request.cached_tokens, request.finish_reason = None, None
    chunk = stream_chunk(request, [], "")
    assert chunk.cached_tokens == 0 and not chunk.finished
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.text = "changed"
