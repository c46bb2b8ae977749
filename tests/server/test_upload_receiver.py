"""The upload receiver on its own: limits, truncation, unsafe paths (no Ray needed)."""
from __future__ import annotations

import asyncio
import hashlib

import pytest

from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.errors import AccessDenied, AdapterError, AdapterTooLarge, RequestError, StoreUnavailable
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.server.uploads import receive_upload, remove_stale_uploads, upload_dir

FILES = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"x" * 10, "README.md": b""}


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
        _receive(_messages(sizes={"adapter_model.safetensors": 5}), tmp_path)


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


@pytest.mark.parametrize("path", ["checkpoint.tar", "optimizer.safetensors", "tokenizer.json", "sub/README.md",
                                  "training_args.bin"])
def test_files_outside_the_family_are_refused_from_the_header(tmp_path, path):
    files = {**FILES, path: b"x"}
    with pytest.raises(AdapterError, match=f"{path.split('/')[0]}"):
        _receive(_messages(files, sizes={path: 2 << 30}), tmp_path, StoreLimits(max_total_bytes=4 << 30))
    assert list(tmp_path.iterdir()) == []  # refused by its name before any byte was written


def test_a_file_beside_a_folder_of_the_same_name_is_a_client_mistake(tmp_path):
    with pytest.raises(AdapterError, match="'x' both as a file and as a folder"):
        _receive(_messages({"x": b"1", "x/y": b"2"}), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_configs_and_docs_are_capped_from_the_header(tmp_path):
    limits = StoreLimits(max_total_bytes=100, max_files=4, max_text_file_bytes=8)
    with pytest.raises(AdapterTooLarge, match="'README.md' is 9 bytes"):
        _receive(_messages({**FILES, "README.md": b"123456789"}), tmp_path, limits)


def test_the_upload_folder_goes_on_every_way_out(tmp_path):
    with upload_dir(tmp_path) as a:
        (a / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError), upload_dir(tmp_path) as b:
        _receive(_messages({"x": b"1", "x/y": b"2"}), b)

    async def cancelled() -> None:
        with upload_dir(tmp_path) as c:
            (c / "README.md").write_text("partial")
            raise asyncio.CancelledError  # the client went away mid-stream

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())
    assert list(tmp_path.iterdir()) == []


def test_a_disk_fault_is_unavailable_without_paths(tmp_path, caplog):
    with pytest.raises(StoreUnavailable, match="cannot receive this upload now") as refused, \
            upload_dir(tmp_path) as dest:
        (dest / "adapter_config.json").mkdir()
        _receive(_messages(), dest)  # writing into a folder: the filesystem refuses
    assert str(tmp_path) not in str(refused.value)
    assert str(tmp_path) in caplog.text  # the operator's log names it
    with pytest.raises(AccessDenied), upload_dir(tmp_path):
        raise AccessDenied("not yours")  # our own refusals are no disk faults
    assert list(tmp_path.iterdir()) == []


def test_only_our_stale_upload_folders_are_removed(tmp_path):
    with upload_dir(tmp_path) as live:
        stale = tmp_path / "adapterserve-upload-crashed"
        stale.mkdir()
        (stale / ".adapterserve-upload").touch()
        (stale / "adapter_model.safetensors").write_bytes(b"x")
        foreign = tmp_path / "adapterserve-upload-notours"  # no marker: somebody else's
        foreign.mkdir()
        assert remove_stale_uploads(3600, tmp_path) == 0
        assert remove_stale_uploads(0, tmp_path) == 2  # the live one too, at grace 0
        assert not stale.exists() and not live.exists() and foreign.exists()
