"""Hostile tenants files: every malformed file, key without scope and quota value of a wrong
type is refused when the server starts (settings.resolve_paths, before any deployment),
naming the file's line and the field, and never echoing a key."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapterserve.adapters_store.tenants import Quotas
from adapterserve.adapters_store.tenants_file import read_keys_file
from adapterserve.server.settings import merge_config, resolve_paths

SECRET = "s3cr3t-key-never-shown"


def _file(quotas: str = "", key: str = f'"{SECRET}"', scopes: str = "[use]", extra: str = "") -> str:
    return f"tenants:\n  acme:\n    keys:\n      - key: {key}\n        scopes: {scopes}\n{extra}{quotas}"


MALFORMED = [  # (file text, what the message says)
    ("tenants:\n", "line 1: tenants must be a mapping of fields, got null"),
    ("tenants: [acme]\n", "line 1: tenants must be a mapping of fields, got a list"),
    ("tenants: {}\n", "line 1: tenants lists no tenant"),
    ("tenants:\n  acme: {}\n", "line 2: tenants.acme lacks the field 'keys'"),
    ("tenants:\n  acme:\n    keys: []\n", "line 3: tenants.acme.keys is empty"),
    ("tenants:\n  acme:\n    keys: {a: b}\n", "line 3: tenants.acme.keys must be a list, got a mapping"),
    ("tenants:\n  acme:\n    keys: [k]\n", "line 3: tenants.acme.keys[0] must be a mapping of fields, got 'k'"),
    (_file(scopes="[]"), "line 5: tenants.acme.keys[0].scopes is empty: a key with no scope can do nothing"),
    (_file(scopes="null"), "line 5: tenants.acme.keys[0].scopes must be a list, got null"),
    (_file(scopes="use"), "line 5: tenants.acme.keys[0].scopes must be a list, got 'use'"),
    (_file(scopes="[read]"), "line 5: tenants.acme.keys[0].scopes holds 'read'; scopes are use, publish, admin"),
    (_file(scopes="[use, use]"), "line 5: tenants.acme.keys[0].scopes lists a scope twice"),
    (_file(scopes="[[use]]"), "line 5: tenants.acme.keys[0].scopes[0] must be a single value, got a list"),
    ("tenants:\n  acme:\n    keys:\n      - scopes: [use]\n", "line 4: tenants.acme.keys[0] lacks the field 'key'"),
    (_file(key="12345"), "line 4: tenants.acme.keys[0].key must be a non-empty string (quote it)"),
    (_file(key='""'), "line 4: tenants.acme.keys[0].key must be a non-empty string"),
    (_file(key="sha256:abc"), "line 4 (tenants.acme.keys[0]): a hashed key is 'sha256:' followed by 64 hex"),
    (_file(key=f"!!python/object/apply:os.system ['{SECRET}']"), "line 4: tenants.acme.keys[0].key must be a "
                                                                  "single value, got a list"),
    (_file(key=f"!!python/name:{SECRET}"), "line 4: tenants.acme.keys[0].key cannot be read: give a plain value"),
    (_file(extra="        note: hi\n"), "line 6: tenants.acme.keys[0] has an unknown field 'note'; known fields: "
                                        "key, scopes"),
    (_file(extra="    limits: {}\n"), "line 6: tenants.acme has an unknown field 'limits'; known fields: keys, "
                                      "quotas"),
    (_file(extra="  acme:\n    keys: []\n"), "line 6: tenants has the field 'acme' twice"),
    (_file(extra="  bad name:\n    keys: []\n"), "line 6: tenants.bad name: tenant 'bad name' is invalid"),
    (_file(extra="  other:\n    keys:\n      - key: \"" + SECRET + "\"\n        scopes: [use]\n"),
     "line 8 (tenants.other.keys[0]): this key is listed twice"),
    ("tenants:\n  acme: [\n", "line 3 is not valid YAML"),
    ("tenants:\n  acme:\n   keys:\n  - x\n", "is not valid YAML"),
    ("tenants:\n  acme: &a\n    keys: *a\n", "tenants.acme.keys must be a list, got a mapping"),
    (_file("    quotas: 5\n"), "line 6: tenants.acme.quotas must be a mapping of fields, got '5'"),
    (_file("    quotas: {adapter: 5}\n"), "line 6: tenants.acme.quotas has an unknown field 'adapter'"),
    (_file("    quotas: {adapters: 1, adapters: 2}\n"), "line 6: tenants.acme.quotas has the field 'adapters' twice"),
    ("tenants:\n  acme:\n    keys: [{key: k, scopes: [use]}]\nextra: 1\n", "line 4: the file has an unknown "
                                                                            "field 'extra'; known fields: tenants"),
]
WRONG_VALUES = ["0", "-1", "1.5", "'5'", "true", "[]", "{}", "1e3", ".inf", ".nan", "'ten'", "2024-01-01", "~5"]


@pytest.mark.parametrize("text, message", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_tenants_file_is_refused_naming_line_and_field(tmp_path, text, message):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_keys_file(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("quota", Quotas.names())
@pytest.mark.parametrize("value", WRONG_VALUES)
def test_every_quota_refuses_every_wrong_type(tmp_path, quota, value):
    path = tmp_path / "tenants.yaml"
    path.write_text(_file(f"    quotas:\n      {quota}: {value}\n"))
    with pytest.raises(ValueError) as info:
        read_keys_file(path)
    assert f"line 7: tenants.acme.quotas.{quota} " in str(info.value)
    assert "must be" in str(info.value) or "cannot be read" in str(info.value) or "single value" in str(info.value)


def test_null_quotas_mean_no_limit(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(_file("    quotas:\n" + "".join(f"      {q}: null\n" for q in Quotas.names())))
    assert read_keys_file(path).caller_for(SECRET).quotas == Quotas()


def test_the_server_refuses_to_start_with_a_malformed_tenants_file(tmp_path, tiny_model):
    path = tmp_path / "tenants.yaml"
    path.write_text(_file(scopes="[]"))
    config = merge_config({"model": str(tiny_model), "encoder": False, "api_keys_file": str(path),
                           "store": str(tmp_path / "store")})
    with pytest.raises(ValueError, match="line 5: tenants.acme.keys.0..scopes is empty"):
        resolve_paths(config)
    assert not Path(tmp_path / "store").exists()
