"""The tenants file: tenants, their keys with scopes, and their quotas, in a small YAML.

    tenants:
      acme:
        keys:
          - key: sha256:<64 hex digits>      # hash_key(KEY); or the key itself
            scopes: [use, publish]
          - key: sha256:<64 hex digits>
            scopes: [use]                    # a read-only key
        quotas:                              # each optional; absent or null = no limit
          bytes_stored: 10000000000
          versions_per_adapter: 10
          adapters: 50
          concurrent_requests: 16
          tokens_per_minute: 200000
      ops:
        keys:
          - key: sha256:<64 hex digits>
            scopes: [admin]

Read strictly: an unknown field, a missing one, a value of the wrong type, a key listed
twice or a tenant without keys is refused with the file's line and the field's path.
`read_keys_file` reads either this or the older 'KEY TENANT' keys file (keys.py): a file
whose first line that is not blank or a comment is `tenants:` is a tenants file.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from adapterserve.adapters_store.keys import ApiKeys, KeyList, check_tenant
from adapterserve.adapters_store.tenants import SCOPES, Caller, Quotas

_TENANT_FIELDS, _KEY_FIELDS = ("keys", "quotas"), ("key", "scopes")


def read_keys_file(path: str | os.PathLike) -> ApiKeys:
    """A tenants file or a 'KEY TENANT' keys file, told apart by the first line of content."""
    text = Path(path).read_text()
    if not _first_content_line(text).startswith("tenants:"):
        return ApiKeys.from_file(path)
    return read_tenants(text, str(path))


def read_tenants(text: str, source: str) -> ApiKeys:
    """Parse a tenants file's `text` (`source` names it in errors)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:  # the problem and its line only: the file's text may hold keys
        mark = getattr(e, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"{source}{line} is not valid YAML: {problem}") from None
    reader = _Reader(source)
    top = reader.mapping(root, "the file", ("tenants",), required=("tenants",))
    tenants = reader.mapping(top["tenants"], "tenants", None)
    if not tenants:
        raise ValueError(reader.at(top["tenants"], "tenants lists no tenant; add one with its keys"))
    keys = KeyList(source)
    for name_node, node in top["tenants"].value:  # checked by `mapping`: string names, each once
        reader.tenant(name_node, node, keys)
    return ApiKeys(keys.digests)


def _first_content_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")), "")


class _Reader:
    """Walks the YAML nodes, so every error can name its line."""

    def __init__(self, source: str) -> None:
        self.source = source

    def at(self, node: Node | None, message: str) -> str:
        line = f", line {node.start_mark.line + 1}" if node is not None else ""
        return f"{self.source}{line}: {message}"

    def tenant(self, name_node: Node, node: Node, keys: KeyList) -> None:
        where = f"tenants.{name_node.value}"
        tenant = _checked(lambda: check_tenant(name_node.value, where), self.at(name_node, ""))
        fields = self.mapping(node, where, _TENANT_FIELDS, required=("keys",))
        quotas = self.quotas(fields.get("quotas"), f"{where}.quotas")
        entries = self.sequence(fields["keys"], f"{where}.keys")
        if not entries:
            raise ValueError(self.at(fields["keys"], f"{where}.keys is empty; a tenant needs at least one key"))
        for i, entry in enumerate(entries):
            self.key(entry, f"{where}.keys[{i}]", tenant, quotas, keys)

    def key(self, node: Node, where: str, tenant: str, quotas: Quotas, keys: KeyList) -> None:
        fields = self.mapping(node, where, _KEY_FIELDS, required=_KEY_FIELDS)
        key = self.scalar(fields["key"], f"{where}.key")
        if not isinstance(key, str) or not key:
            raise ValueError(self.at(fields["key"], f"{where}.key must be a non-empty string (quote it)"))
        scopes = self.scopes(fields["scopes"], f"{where}.scopes")
        line = f"line {node.start_mark.line + 1} ({where})"
        keys.add(key, Caller(tenant, scopes, quotas), line)

    def scopes(self, node: Node, where: str) -> frozenset[str]:
        values = [self.scalar(n, f"{where}[{i}]") for i, n in enumerate(self.sequence(node, where))]
        if not values:
            raise ValueError(self.at(node, f"{where} is empty: a key with no scope can do nothing; give it some "
                                           f"of {', '.join(SCOPES)}"))
        for value in values:
            if value not in SCOPES:
                raise ValueError(self.at(node, f"{where} holds {value!r}; scopes are {', '.join(SCOPES)}"))
        if len(set(values)) != len(values):
            raise ValueError(self.at(node, f"{where} lists a scope twice"))
        return frozenset(values)

    def quotas(self, node: Node | None, where: str) -> Quotas:
        if node is None or _is_null(node):
            return Quotas()
        fields = self.mapping(node, where, Quotas.names())
        limits = {}
        for name, value_node in fields.items():
            value = self.scalar(value_node, f"{where}.{name}")
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(self.at(value_node, f"{where}.{name} must be a whole number >= 1 (or null for no "
                                                     f"limit), got {value!r}"))
            limits[name] = value
        return Quotas(**limits)

    def mapping(self, node: Node, where: str, allowed: tuple[str, ...] | None,
                required: tuple[str, ...] = ()) -> dict[str, Node]:
        if not isinstance(node, MappingNode):
            raise ValueError(self.at(node, f"{where} must be a mapping of fields, got {_kind(node)}"))
        found: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node, f"a field name of {where}")
            if not isinstance(key, str):
                raise ValueError(self.at(key_node, f"{where} has a field name {key!r} that is not a string"))
            if allowed is not None and key not in allowed:
                raise ValueError(self.at(key_node, f"{where} has an unknown field {key!r}; known fields: "
                                                   f"{', '.join(allowed)}"))
            if key in found:
                raise ValueError(self.at(key_node, f"{where} has the field {key!r} twice"))
            found[key] = value_node
        for key in required:
            if key not in found:
                raise ValueError(self.at(node, f"{where} lacks the field {key!r}"))
        return found

    def sequence(self, node: Node, where: str) -> list[Node]:
        if not isinstance(node, SequenceNode):
            raise ValueError(self.at(node, f"{where} must be a list, got {_kind(node)}"))
        return list(node.value)

    def scalar(self, node: Node, where: str) -> object:
        if not isinstance(node, ScalarNode):
            raise ValueError(self.at(node, f"{where} must be a single value, got {_kind(node)}"))
        try:
            return SafeConstructor().construct_object(node)
        except (ConstructorError, ValueError):  # the value and its tag may hold a key: name neither
            raise ValueError(self.at(node, f"{where} cannot be read: give a plain value, with no YAML tag "
                                           "('!!...')")) from None


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _kind(node: Node | None) -> str:
    if node is None:
        return "nothing"
    if _is_null(node):
        return "null"
    return {MappingNode: "a mapping", SequenceNode: "a list"}.get(type(node), f"{node.value!r}")


def _checked(check, prefix: str):
    """Run `check`; its ValueError gets the node's place in front."""
    try:
        return check()
    except ValueError as e:
        raise ValueError(prefix + str(e)) from None
