"""API keys -> tenants."""
from __future__ import annotations

import pytest

from adapterserve.adapters_store.keys import ApiKeys, hash_key
from adapterserve.errors import Unauthenticated

KEY_FILE = """\
# production tenants
{acme_hash} acme

plain-key-for-dev dev
second-key-for-acme acme
"""


@pytest.fixture
def keys(tmp_path) -> ApiKeys:
    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE.format(acme_hash=hash_key("acme-secret-1")))
    return ApiKeys.from_file(path)


def test_plain_and_hashed_keys_map_to_tenants(keys):
    assert keys.tenant_for("acme-secret-1") == "acme"
    assert keys.tenant_for("second-key-for-acme") == "acme"
    assert keys.tenant_for("plain-key-for-dev") == "dev"
    assert keys.tenants == {"acme", "dev"}
    assert not keys.is_open


@pytest.mark.parametrize("key", ["wrong", "acme-secret-1 ", hash_key("acme-secret-1"), "ACME-SECRET-1"])
def test_unknown_keys_are_refused(keys, key):
    with pytest.raises(Unauthenticated, match="not recognised"):
        keys.tenant_for(key)


@pytest.mark.parametrize("key", [None, ""])
def test_a_missing_key_is_refused(keys, key):
    with pytest.raises(Unauthenticated, match="required"):
        keys.tenant_for(key)


def test_open_mode_has_no_tenant():
    keys = ApiKeys.open()
    assert keys.is_open
    assert keys.tenant_for(None) is None and keys.tenant_for("anything") is None


def test_repr_reveals_no_keys(keys):
    assert "plain-key" not in repr(keys) and "sha256" not in repr(keys)
    assert repr(keys) == "ApiKeys(3 keys, 2 tenants)"


def test_hash_key_form():
    h = hash_key("k")
    assert h.startswith("sha256:") and len(h) == 7 + 64
    assert ApiKeys.from_mapping({h: "t"}).tenant_for("k") == "t"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("just-a-key\n", "line 1: expected 'KEY TENANT'"),
        ("# c\nk t extra\n", "line 2: expected 'KEY TENANT'"),
        ("sha256:abc t\n", "64 hex digits"),
        ("k bad/tenant\n", "tenant 'bad/tenant' is invalid"),
        ("k t\nk u\n", "line 2: this key is listed twice"),
        (f"k t\n{hash_key('k')} u\n", "line 2: this key is listed twice"),
        ("# nothing\n\n", "holds no API keys"),
    ],
)
def test_malformed_key_files_are_refused(tmp_path, text, error):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        ApiKeys.from_file(path)
