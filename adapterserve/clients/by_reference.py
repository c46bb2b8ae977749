"""`adapterserve upload s3://bucket/prefix --name NAME`: the server fetches the adapter itself.

The CLI sends the reference to the server's HTTP route /v1/load_lora_adapter (vLLM's):
the server reads the S3 location with its own credentials (if its config's
`lora_sources` allows that location), validates and publishes the next version of NAME.
Standard library only (a client-only install has no HTTP client package).

The HTTP address: --http-url, else $ADAPTERSERVE_HTTP_URL, else port 8000 on the gRPC
server's host (the ports `adapterserve serve` takes by default).
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

DEFAULT_HTTP_PORT = 8000


class LoadRefused(Exception):
    """The server refused the load (its HTTP status and message), or could not be reached."""


def http_url(given: str | None, grpc_server: str) -> str:
    """The server's HTTP base URL (no trailing /v1)."""
    url = given or os.environ.get("ADAPTERSERVE_HTTP_URL")
    if url:
        return url.rstrip("/").removesuffix("/v1")
    host = grpc_server.rpartition(":")[0] or grpc_server
    return f"http://{host}:{DEFAULT_HTTP_PORT}"


def load_by_reference(base_url: str, uri: str, name: str, *, api_key: str | None = None, public: bool = False,
                      timeout: float = 600.0) -> dict[str, Any]:
    """Ask the server at `base_url` to publish the adapter at `uri` as the next version of `name`;
    returns the new version's model object (`id` is NAME@N)."""
    body = json.dumps({"lora_name": name, "lora_path": uri, "public": public}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{base_url}/v1/load_lora_adapter", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise LoadRefused(f"HTTP {exc.code}: {_message(exc.read())}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LoadRefused(f"cannot reach {base_url} ({reason}); give the server's HTTP address with "
                          "--http-url") from None


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]
