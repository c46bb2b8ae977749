"""What the server says about prefix-cache hits: the gRPC chunk's cached_tokens (read back by
the client), and the cache salt that keeps private adapters' blocks within their tenant."""
from datetime import datetime, timezone

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.clients.types import Chunk, Completion
from adapterserve.server.messages import chunk_message
from adapterserve.server.replica import cache_salt


def _version(tenant: str | None, public: bool) -> AdapterVersion:
    return AdapterVersion("sql", 1, "ab" * 32, tenant, public, datetime.now(timezone.utc), 1, ("a",))


def test_the_first_chunk_carries_cached_tokens_to_the_client():
    first = {"request_id": "r", "token_ids": [5], "text": "a", "finish_reason": None, "adapter": "sql@1",
             "prompt_tokens": 40, "cached_tokens": 32}
    last = {"request_id": "r", "token_ids": [6], "text": "b", "finish_reason": "stop"}
    chunks = [Chunk.from_proto(chunk_message(c)) for c in (first, last)]
    assert [c.cached_tokens for c in chunks] == [32, 0]
    done = Completion.from_chunks(chunks)
    assert (done.prompt_tokens, done.cached_tokens) == (40, 32) and done.to_json()["cached_tokens"] == 32


def test_private_adapters_are_salted_with_their_tenant_and_shared_ones_are_not():
    assert cache_salt(_version("acme", public=False)) == "tenant:acme"
    assert cache_salt(_version("acme", public=False)) != cache_salt(_version("globex", public=False))
    assert cache_salt(_version("acme", public=True)) == "" and cache_salt(None) == ""
    assert cache_salt(_version(None, public=False)) == ""  # open mode: no tenants
