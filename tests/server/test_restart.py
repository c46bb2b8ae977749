"""Restarting the application on the same store: the same adapters, the same outputs."""
from __future__ import annotations

from ray import serve

from adapterserve.server import launch


def test_restart_with_the_same_store_lists_the_same_adapters(server, alice, uploaded):
    before = [(a.ref, a.content_hash, a.tenant) for a in alice.list_adapters()]
    tokens = alice.generate("To make bread", adapter="chat", max_tokens=6, temperature=0.0).token_ids
    launch.stop(server.config)
    assert "adapterserve" not in serve.status().applications
    launch.start(server.config, grpc_port=server.grpc_port, http_port=server.http_port)
    assert [(a.ref, a.content_hash, a.tenant) for a in alice.list_adapters()] == before
    assert set(uploaded.values()) <= {ref for ref, _, _ in before}
    after = alice.generate("To make bread", adapter="chat", max_tokens=6, temperature=0.0)
    assert after.token_ids == tokens
    assert alice.server_info().loaded_adapters == [alice.get_adapter("chat").content_hash]  # a fresh replica
