"""Tenants on the live server (its tenants file: tests/helpers/live_server.py TENANTS): another
tenant's private adapter is NOT_FOUND exactly like a name nobody has, everywhere; keys carry
scopes; an admin sees every tenant; list/info show a key's own scopes and usage; the store's
quotas refuse a publish with nothing stored; concurrent_requests and tokens_per_minute refuse
with RESOURCE_EXHAUSTED / 429 naming the quota while other tenants get exactly their tokens."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import requests

from adapterserve.clients.client import Client
from adapterserve.clients.types import ClientError
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from tests.helpers.held_calls import held_while, wait_until
from tests.helpers.live_server import (
    ADMIN,
    ALICE,
    BOB,
    BUSY,
    BUSY_CONCURRENCY,
    CAROL_PUBLISH,
    CAROL_USE,
    METERED,
    METERED_TOKENS,
    SMALL,
    run_cli,
)

PROMPT = "The lighthouse keeper"


def _refusal(call) -> ClientError:
    with pytest.raises(ClientError) as info:
        call()
    return info.value


def _client(server, key: str) -> Client:
    return Client(server.grpc, api_key=key, timeout=120)


def _http(server, method: str, route: str, key: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{server.http}/v1/{route}", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})


# --- no existence leak ------------------------------------------------------------


def test_another_tenants_private_adapter_is_not_found_like_a_missing_name(server, bob, uploaded):
    def same_as_missing(call, missing_call) -> None:
        theirs, nobodys = _refusal(call), _refusal(missing_call)
        assert theirs.code is nobodys.code is grpc.StatusCode.NOT_FOUND
        assert theirs.details == nobodys.details.replace("nobodys", "sql")

    same_as_missing(lambda: bob.generate(PROMPT, adapter="sql", max_tokens=2),
                    lambda: bob.generate(PROMPT, adapter="nobodys", max_tokens=2))
    same_as_missing(lambda: bob.generate(PROMPT, adapter="sql@1", max_tokens=2),
                    lambda: bob.generate(PROMPT, adapter="nobodys@1", max_tokens=2))
    same_as_missing(lambda: bob.get_adapter("sql"), lambda: bob.get_adapter("nobodys"))
    same_as_missing(lambda: bob.delete_adapter("sql@1"), lambda: bob.delete_adapter("nobodys@1"))
    same_as_missing(lambda: bob.delete_adapter("sql"), lambda: bob.delete_adapter("nobodys"))
    assert bob.list_adapters("sql") == [] and "sql" not in {a.name for a in bob.list_adapters()}
    cli = [run_cli("list", name, "--server", server.grpc, "--api-key", BOB) for name in ("sql", "nobodys")]
    assert cli[0][0] == cli[1][0] == 1 and cli[0][2] == cli[1][2].replace("nobodys", "sql")

    for method, route, body in (("GET", "models/{}", None), ("POST", "completions", {"prompt": "hi", "model": "{}"}),
                                ("POST", "unload_lora_adapter", {"lora_name": "{}"})):
        replies = []
        for name in ("sql", "nobodys"):
            filled = {k: v.format(name) for k, v in (body or {}).items()}
            replies.append(_http(server, method, route.format(name), BOB, filled or None))
        assert replies[0].status_code == replies[1].status_code == 404, replies[0].text
        theirs, nobodys = (r.json()["error"] for r in replies)
        assert theirs["message"] == nobodys["message"].replace("nobodys", "sql")
        assert theirs["type"] == "not_found_error"
    models = _http(server, "GET", "models", BOB).json()
    assert not any(m["id"].startswith("sql") for m in models["data"])


# --- scopes -----------------------------------------------------------------------


def test_a_use_key_serves_but_may_not_publish_or_delete(server, lora_dirs):
    with _client(server, CAROL_PUBLISH) as publisher, _client(server, CAROL_USE) as reader:
        published = publisher.upload(lora_dirs["poem"], "carol-poem")
        assert reader.get_adapter("carol-poem").ref == published.ref  # the same tenant's adapter
        assert reader.generate(PROMPT, adapter="carol-poem", max_tokens=2).token_ids
        for call in (lambda: reader.upload(lora_dirs["sql"], "carol-other"),
                     lambda: reader.delete_adapter("carol-poem")):
            refused = _refusal(call)
            assert refused.code is grpc.StatusCode.PERMISSION_DENIED
            assert "lacks the 'publish' scope" in refused.details and "(the key's scopes: use)" in refused.details
        for call in (lambda: publisher.generate(PROMPT, max_tokens=2), publisher.list_adapters,
                     publisher.server_info):
            refused = _refusal(call)
            assert refused.code is grpc.StatusCode.PERMISSION_DENIED and "lacks the 'use' scope" in refused.details
        reply = _http(server, "POST", "unload_lora_adapter", CAROL_USE, {"lora_name": "carol-poem"})
        assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_error"
        assert "'publish' scope" in reply.json()["error"]["message"]
        assert _http(server, "GET", "models", CAROL_PUBLISH).status_code == 403
        assert [a.ref for a in reader.list_adapters("carol-poem")] == [published.ref]  # nothing was deleted


def test_an_admin_key_sees_uses_and_deletes_every_tenants_adapters(server, alice, uploaded, lora_dirs):
    with _client(server, ADMIN) as admin, _client(server, CAROL_PUBLISH) as carol:
        listing = admin.listing()
        assert {"sql", "chat", "poem"} <= {a.name for a in listing.adapters}  # alice's private ones
        assert listing.usage.tenant == "ops" and listing.usage.scopes == ["admin"]
        assert {"alice", "bob", "carol", "small", "busy", "metered"} <= {t.tenant for t in listing.tenants}
        theirs = alice.generate(PROMPT, adapter=uploaded["sql"], max_tokens=4, temperature=0.0)
        mine = admin.generate(PROMPT, adapter=uploaded["sql"], max_tokens=4, temperature=0.0)
        assert mine.token_ids == theirs.token_ids
        doomed = carol.upload(lora_dirs["sql"], "carol-doomed")
        assert admin.delete_adapter("carol-doomed") == [doomed.ref]
        assert _refusal(lambda: admin.get_adapter("carol-doomed")).code is grpc.StatusCode.NOT_FOUND


# --- usage --------------------------------------------------------------------------


def test_list_and_info_show_the_keys_own_scopes_and_usage(server, alice, uploaded):
    listing = alice.listing()
    own = [a for a in listing.adapters if a.tenant == "alice"]
    usage = listing.usage
    assert (usage.tenant, usage.scopes, listing.tenants) == ("alice", ["use", "publish"], [])
    assert usage.adapters == len({a.name for a in own}) and usage.bytes_stored == sum(a.size_bytes for a in own)
    assert usage.quotas == dict.fromkeys(usage.quotas)  # alice has no quotas
    assert alice.server_info().usage.tenant == "alice"
    status, out, err = run_cli("list", "--server", server.grpc, "--api-key", ALICE)
    assert status == 0, err
    line = next(row for row in out.splitlines() if row.startswith("alice "))
    assert line.split()[1:3] == ["use,publish", str(usage.bytes_stored)]
    body = _http(server, "GET", "models", ALICE).json()
    assert (body["tenant"]["tenant"], body["tenant"]["bytes_stored"]) == ("alice", usage.bytes_stored)


# --- the store's quotas ---------------------------------------------------------------


def test_store_quotas_refuse_a_publish_with_nothing_stored(server, lora_dirs):
    with _client(server, SMALL) as small:
        first = small.upload(lora_dirs["sql"], "small-a")
        second = small.upload(lora_dirs["chat"], "small-a")
        assert small.upload(lora_dirs["chat"], "small-a") == second  # the same content: no new version
        over = _refusal(lambda: small.upload(lora_dirs["poem"], "small-a"))
        assert over.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert over.details.startswith("tenant small: versions_per_adapter 2 reached ('small-a' has 2 live versions)")
        other = _refusal(lambda: small.upload(lora_dirs["poem"], "small-b"))
        assert other.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert other.details.startswith("tenant small: adapters 1 reached")
        assert [a.ref for a in small.list_adapters() if a.tenant == "small"] == [first.ref, second.ref]
        assert not (server.store_dir / "meta" / "small-b").exists()
        assert not (server.store_dir / "data" / "small-b").exists()
        stored = {p.name for p in (server.store_dir / "data" / "small-a").iterdir()}
        assert stored == {first.content_hash, second.content_hash}
        usage = small.listing().usage
        assert (usage.adapters, usage.quotas["versions_per_adapter"], usage.quotas["adapters"]) == (1, 2, 1)
        small.delete_adapter(first.ref)  # room again
        assert small.upload(lora_dirs["poem"], "small-a").version == 3


# --- concurrent requests and tokens per minute ------------------------------------------


def _admin_usage(server, tenant: str):
    with _client(server, ADMIN) as admin:
        return next(t for t in admin.listing().tenants if t.tenant == tenant)


def test_calls_past_the_concurrency_quota_are_refused_and_others_get_their_tokens(server, alice, uploaded,
                                                                                  reference):
    expected, _ = reference("sql", PROMPT, 6)

    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.AdapterServeStub(channel)
            held = await held_while(stub, BUSY_CONCURRENCY, (("x-api-key", BUSY),),
                                    lambda: _admin_usage(server, "busy").requests_in_flight == 2,
                                    "busy's held calls to take their places")
            burst = [_generate(stub, BUSY) for _ in range(4)]
            served = asyncio.to_thread(alice.generate, PROMPT, adapter="sql", max_tokens=6, temperature=0.0)
            refusals, other = await asyncio.gather(asyncio.gather(*burst), served)
            for call in held:
                call.cancel()
            return refusals, other

    refusals, other = asyncio.run(scenario())
    assert other.token_ids == expected  # another tenant is unaffected, token for token
    for code, details, trailing in refusals:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and trailing["retry-after-s"] == "1"
        assert details == (f"tenant busy: concurrent_requests {BUSY_CONCURRENCY} reached (2 in flight); retry when "
                           "one ends")
    wait_until(lambda: _admin_usage(server, "busy").requests_in_flight == 0, "busy's places to be given back")
    with _client(server, BUSY) as busy:
        assert busy.generate(PROMPT, adapter=None, max_tokens=6, temperature=0.0).token_ids == reference(
            None, PROMPT, 6)[0]


async def _generate(stub, key: str) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=4)),
                         metadata=(("x-api-key", key),), timeout=120)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as refused:
        return refused.code(), refused.details(), dict(refused.trailing_metadata() or ())
    return grpc.StatusCode.OK, "", {}


def test_tokens_per_minute_refuses_once_the_window_holds_the_limit(server, reference):
    with _client(server, METERED) as metered:
        done = metered.generate(PROMPT, max_tokens=METERED_TOKENS, ignore_eos=True, temperature=0.0)
        used = done.prompt_tokens + len(done.token_ids)
        assert used >= METERED_TOKENS
        refused = _refusal(lambda: metered.generate(PROMPT, max_tokens=2))
        assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.details.startswith(f"tenant metered: tokens_per_minute {METERED_TOKENS} reached ({used} in "
                                          "the last 60 s); retry after ")
        reply = _http(server, "POST", "completions", METERED, {"model": "tiny-llama", "prompt": "hi"})
        assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(reply.headers["Retry-After"]) <= 60
        assert "tokens_per_minute" in reply.json()["error"]["message"]
        assert metered.listing().usage.tokens_last_minute == used  # listing is no token call: it is served
