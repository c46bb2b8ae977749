"""A real S3-compatible server (moto's server mode, over HTTP on loopback) for the live server.

Credentials are passed explicitly (to the server's `lora_s3_options` and to test
clients), so nothing depends on the environment Ray's workers inherited.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@dataclass(frozen=True)
class MotoS3:
    endpoint: str
    bucket: str  # created empty at start

    @property
    def options(self) -> dict[str, Any]:
        """boto3 client options reaching this server."""
        return {"endpoint_url": self.endpoint, **CREDENTIALS}

    def client(self):
        import boto3

        return boto3.client("s3", **self.options)

    def put_dir(self, directory: Path, prefix: str) -> str:
        """Copy `directory`'s files under `prefix`; returns s3://bucket/prefix."""
        client = self.client()
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            client.upload_file(str(path), self.bucket, f"{prefix}/{path.relative_to(directory).as_posix()}")
        return f"s3://{self.bucket}/{prefix}"


def start_moto():
    """(the running moto server, MotoS3); stop the server with .stop()."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = MotoS3(f"http://{host}:{port}", f"sources-{uuid.uuid4().hex[:8]}")
    s3.client().create_bucket(Bucket=s3.bucket)
    return server, s3
