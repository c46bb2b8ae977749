"""What an upload sends: the files, their sizes and hashes, in ordered chunks."""
from __future__ import annotations

import hashlib

import pytest

from adapterserve.clients import upload_stream
from adapterserve.clients.upload_stream import collect_files, upload_messages


def test_collects_top_level_and_one_directory_down(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.json").write_text("[]")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x").write_text("skip")
    (tmp_path / ".gitattributes").write_text("skip")
    (tmp_path / "link.json").symlink_to(tmp_path / "adapter_config.json")  # read through, like an HF cache
    files = collect_files(tmp_path)
    assert [f.path for f in files] == ["adapter_config.json", "link.json", "tok/vocab.json"]
    assert files[0].sha256 == hashlib.sha256(b"{}").hexdigest() and files[0].size == 2


def test_messages_are_a_header_then_ordered_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(upload_stream, "CHUNK_BYTES", 4)
    data = bytes(range(10))
    (tmp_path / "w.safetensors").write_bytes(data)
    sent = []
    messages = list(upload_messages("n", collect_files(tmp_path), public=True, progress=sent.append))
    header = messages[0].header
    assert (header.name, header.public, header.files[0].size) == ("n", True, 10)
    chunks = [m.chunk for m in messages[1:]]
    assert [c.offset for c in chunks] == [0, 4, 8]
    assert b"".join(c.data for c in chunks) == data and sum(sent) == 10


def test_a_missing_directory_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        collect_files(tmp_path / "nope")
