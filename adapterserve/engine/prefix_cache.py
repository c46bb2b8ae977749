"""Adapter-aware prefix caching: a request reuses the KV blocks of an earlier request's
identical prefix, computed under the same KV identity.

A full block's key chains the keys before it:

    key[0] = H(root, ids of block 0)      root = H(kv identity, cache salt)
    key[i] = H(key[i-1], ids of block i)

so a key names every token up to the block's end. The *KV identity* says what made the
keys and values: an adapter's content fingerprint when it changes any layer's K/V (LoRA,
(IA)^3 or a bottleneck below the last layer's attention, or on any k/v projection; every
prompt-tuning and prefix-tuning adapter), else the base model's (a classifier head only;
modules only after the last layer's keys and values). A new version of an adapter has new
content, so it never meets the old version's blocks. The *salt* keeps requests apart that
must not share (the server salts private adapters' requests with their tenant): a hit is
visible as a shorter time to first token, so sharing would tell one tenant what another
sent. docs/prefix_caching.md has the whole policy.

The last token of a request is always computed (its logits are needed), so a request
reuses at most its full blocks before that token.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.request import Request

BASE = b"base"  # the KV identity of the base model, and of adapters that leave its K/V unchanged
_KV_KINDS = ("k_proj", "v_proj")
_NOT_CONTENT = ("staged", "head")  # host copies; a classifier head acts after the last layer
_HASH_THREADS = min(8, os.cpu_count() or 1)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def changes_kv(adapter: Adapter, num_layers: int) -> bool:
    """Whether serving under `adapter` gives any layer other keys or values than the base model."""
    if adapter.prompt is not None or adapter.prefix is not None:
        return True
    for family in (adapter.lora, adapter.ia3, adapter.bottleneck):
        modules = getattr(family, "modules", None) or getattr(family, "scales", None) or {}
        for layer, kind in modules:
            if layer < num_layers - 1 or kind in _KV_KINDS:
                return True
    return False


def kv_identity(adapter: Adapter | None, num_layers: int) -> bytes:
    """BASE, or a fingerprint of everything in the adapter that acts on the KV."""
    if adapter is None or not changes_kv(adapter, num_layers):
        return BASE
    parts: list[bytes | torch.Tensor] = []
    _content(adapter, parts)
    digests = _tensor_digests({id(p): p for p in parts if isinstance(p, torch.Tensor)})
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(digests[id(part)] if isinstance(part, torch.Tensor) else part)
    return h.digest()


def _tensor_digests(tensors: dict[int, torch.Tensor]) -> dict[int, bytes]:
    """id -> the digest of each tensor's dtype, shape and bytes, hashed on a thread pool
    (hashlib lets go of the GIL): a 70B LoRA is about 1 GB of bytes."""
    if len(tensors) < 2:
        return {key: _tensor_digest(t) for key, t in tensors.items()}
    with ThreadPoolExecutor(min(_HASH_THREADS, len(tensors))) as pool:
        return dict(zip(tensors, pool.map(_tensor_digest, tensors.values())))


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().cpu().contiguous()
    return _digest(f"tensor {t.dtype} {tuple(t.shape)};".encode(), t.reshape(-1).view(torch.uint8).numpy())


def _content(value, parts: list[bytes | torch.Tensor]) -> None:
    """A value's content in a fixed order, appended to parts: bytes, and tensors (hashed apart)."""
    if isinstance(value, torch.Tensor):
        parts.append(value)
    elif dataclasses.is_dataclass(value):
        parts.append(f"{type(value).__name__}(".encode())
        for f in dataclasses.fields(value):
            if f.name not in _NOT_CONTENT:
                parts.append(f"{f.name}=".encode())
                _content(getattr(value, f.name), parts)
        parts.append(b")")
    elif isinstance(value, dict):
        parts.append(b"{")
        for key in sorted(value, key=repr):
            parts.append(f"{key!r}:".encode())
            _content(value[key], parts)
        parts.append(b"}")
    elif isinstance(value, (list, tuple)):
        parts.append(b"[")
        for item in value:
            _content(item, parts)
        parts.append(b"]")
    elif isinstance(value, (set, frozenset)):
        parts.append(repr(sorted(value, key=repr)).encode())
    else:
        parts.append(f"{value!r};".encode())


class KvIdentities:
    """Each registered adapter's KV identity, computed once per registration (thread-safe)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._known: dict[str, tuple[Adapter, bytes]] = {}
        self._lock = threading.Lock()

    def of(self, adapter_id: str, adapter: Adapter, registered: dict[str, Adapter]) -> bytes:
        """The identity of `adapter` (registered under adapter_id); forgets ids no longer registered."""
        known = self._known.get(adapter_id)
        if known is not None and known[0] is adapter:
            return known[1]
        identity = kv_identity(adapter, self.num_layers)
        with self._lock:
            for stale in [i for i in self._known if i not in registered]:
                del self._known[stale]
            self._known[adapter_id] = (adapter, identity)
        return identity


def chain_root(identity: bytes, salt: str) -> bytes:
    """The key every block chain of this KV identity and salt starts from."""
    return _digest(b"root", identity, b"\0", salt.encode())


class PrefixCache:
    """Finds a waiting request's cached prefix and makes its full computed blocks findable."""

    def __init__(self, blocks: BlockManager, enabled: bool) -> None:
        self.blocks = blocks
        self.enabled = enabled

    def match(self, request: Request) -> None:
        """Give a request that holds no blocks the cached blocks of its longest cached prefix;
        its computation starts after them."""
        if not self.enabled or request.blocks:
            return
        usable = (request.num_tokens - request.pending - 1) // self.blocks.block_size
        request.blocks = self.blocks.lookup(self._keys(request, usable))
        request.num_remembered = len(request.blocks)
        request.num_computed = request.num_remembered * self.blocks.block_size

    def unmatch(self, request: Request) -> None:
        """Undo match for a request that is not admitted after all."""
        self.blocks.release(request.blocks)
        request.num_computed = request.num_remembered = 0

    def admitted(self, request: Request) -> None:
        """A request starts running: on its first admission, note its prompt tokens found cached."""
        if self.enabled and request.cached_tokens is None:
            prompt = len(request.prompt_ids)
            request.cached_tokens = min(prompt, max(0, request.num_computed - request.num_virtual))

    def remember(self, request: Request) -> None:
        """Make the request's full blocks whose tokens are computed and known findable."""
        if not self.enabled or request.num_computed // self.blocks.block_size <= request.num_remembered:
            return  # no block filled since
        known = request.num_tokens - request.pending
        full = min(request.num_computed, known, len(request.blocks) * self.blocks.block_size) // self.blocks.block_size
        if full <= request.num_remembered:
            return
        keys = self._keys(request, full)
        for i in range(request.num_remembered, full):
            self.blocks.cache(request.blocks[i], keys[i])
        request.num_remembered = full

    def _keys(self, request: Request, count: int) -> list[bytes]:
        """The keys of the request's first `count` blocks (extending those already computed)."""
        keys, size = request.block_keys, self.blocks.block_size
        while len(keys) < count:
            i = len(keys)
            ids = array("q", request.token_ids(i * size, (i + 1) * size)).tobytes()
            keys.append(_digest(keys[-1] if keys else request.cache_root, ids))
        return keys[:count]
