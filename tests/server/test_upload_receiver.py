"""The upload receiver on its own: limits, truncation, unsafe paths (no Ray needed)."""
from __future__ import annotations

import asyncio
import hashlib

import pytest

from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.errors import AdapterError, AdapterTooLarge, RequestError
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.server.uploads import receive_upload

FILES = {"adapter_config.json": b"{}", "sub/adapter_model.safetensors": b"x" * 10, "empty.txt": b""}


def _messages(files=FILES, name="ok", sizes=None, chunk=4):
    entries = [pb.FileEntry(path=p, size=(sizes or {}).get(p, len(d)), sha256=hashlib.sha256(d).hexdigest())
               for p, d in files.items()]
    yield pb.UploadAdapterRequest(header=pb.UploadHeader(name=name, files=entries))
    for path, data in files.items():
        for i in range(0, len(data), chunk):
            yield pb.UploadAdapterRequest(chunk=pb.FileChunk(path=path, offset=i, data=data[i:i + chunk]))


async def _aiter(messages):
    for m in messages:
        yield m


LIMITS = StoreLimits(max_total_bytes=100, max_files=4)


def _receive(messages, dest, limits=LIMITS):
    return asyncio.run(receive_upload(_aiter(messages), dest, limits))


def test_files_arrive_whole(tmp_path):
    header = _receive(_messages(), tmp_path)
    assert header.name == "ok"
    assert {p: (tmp_path / p).read_bytes() for p in FILES} == FILES


@pytest.mark.parametrize("limits", [StoreLimits(max_total_bytes=11, max_files=4),
                                    StoreLimits(max_total_bytes=100, max_files=2)])
def test_over_the_limits_is_refused_before_writing(tmp_path, limits):
    with pytest.raises(AdapterTooLarge):
        _receive(_messages(), tmp_path, limits)
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_is_refused(tmp_path):
    sizes = {"adapter_config.json": 3}
    with pytest.raises(AdapterError, match="truncated"):
        _receive(_messages(sizes=sizes), tmp_path)


def test_more_bytes_than_declared_are_refused(tmp_path):
    with pytest.raises(AdapterTooLarge, match="more than the declared"):
        _receive(_messages(sizes={"sub/adapter_model.safetensors": 5}), tmp_path)


@pytest.mark.parametrize("path", ["../x.json", "/abs.json", "a/b/c.json", ".hidden", "sub/../../x"])
def test_unsafe_paths_are_refused(tmp_path, path):
    with pytest.raises(AdapterError, match="not accepted"):
        _receive(_messages({path: b"{}"}), tmp_path / "dest")
    assert not (tmp_path / "x.json").exists()


def test_out_of_order_chunks_are_refused(tmp_path):
    messages = list(_messages())
    messages[2], messages[3] = messages[3], messages[2]
    with pytest.raises(RequestError, match="offset"):
        _receive(messages, tmp_path)


def test_a_stream_must_start_with_the_header(tmp_path):
    with pytest.raises(RequestError, match="header"):
        _receive(list(_messages())[1:], tmp_path)
    with pytest.raises(RequestError, match="name"):
        _receive(_messages(name="Bad Name"), tmp_path)
