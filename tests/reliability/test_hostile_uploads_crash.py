"""A server killed mid-upload leaves its upload folder and staging behind; the next start
removes them (only ours), and a local store refuses a multi-node cluster."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adapterserve.adapters_store.local import LocalStore
from adapterserve.server.store_fit import check_store_fits, clean_crash_leftovers

_RECEIVER = textwrap.dedent("""
    import asyncio, hashlib, sys
    from pathlib import Path
    from adapterserve.adapters_store.staging import StoreLimits
    from adapterserve.proto import adapterserve_pb2 as pb
    from adapterserve.server.uploads import receive_upload, upload_dir

    data = b"x" * 4096
    entry = pb.FileEntry(path="adapter_model.safetensors", size=len(data), sha256=hashlib.sha256(data).hexdigest())

    async def stream(dest):
        yield pb.UploadAdapterRequest(header=pb.UploadHeader(name="a", files=[entry]))
        yield pb.UploadAdapterRequest(chunk=pb.FileChunk(path=entry.path, offset=0, data=data[:1024]))
        print(dest, flush=True)
        await asyncio.sleep(3600)  # the rest never comes: the server is killed here

    async def main():
        with upload_dir(sys.argv[1]) as dest:
            await receive_upload(stream(dest), dest, StoreLimits())

    asyncio.run(main())
""")


def test_a_kill_mid_upload_is_cleaned_at_the_next_start(tmp_path):
    uploads, store = tmp_path / "tmp", LocalStore(tmp_path / "store")
    uploads.mkdir()
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(uploads)], stdout=subprocess.PIPE, text=True)
    try:
        dest = Path(receiver.stdout.readline().strip())
        assert (dest / "adapter_model.safetensors").stat().st_size == 1024  # mid-stream
    finally:
        os.kill(receiver.pid, signal.SIGKILL)
        receiver.wait()
    staging = store.root / ".tmp" / "publish-crashed"  # a publish killed while staging its copy
    staging.mkdir()
    (staging / "adapter_model.safetensors").write_bytes(b"x")
    foreign = uploads / "adapterserve-upload-foreign"  # not marked as ours
    foreign.mkdir()
    assert dest.exists()  # the kill left it

    clean_crash_leftovers(LocalStore(store.root), 3600, uploads)  # a restart soon after: could be live
    assert dest.exists() and staging.exists()
    clean_crash_leftovers(LocalStore(store.root), 0, uploads)
    assert not dest.exists() and not staging.exists() and foreign.exists()


def test_a_local_store_refuses_a_multi_node_cluster(tmp_path):
    store = LocalStore(tmp_path / "store")
    check_store_fits(store, 1)
    with pytest.raises(ValueError, match="local directory, but this Ray cluster has 2 nodes.*s3://"):
        check_store_fits(store, 2)

