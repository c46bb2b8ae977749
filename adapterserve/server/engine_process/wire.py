"""The pipe between a replica and its engine process.

Parent -> child, tuples:
    ("stream", call_id, prompt, sampling, adapter_id, request_id, timed, cache_salt)
                                          timed: send its RequestTimes; cache_salt: Engine.add_request's
    ("streams", [payload, ...])           the stream starts of one loop turn of the parent, each
                                          a pickled ("stream", ...)
    ("call", call_id, method, args)       method in CALLS; a reply comes back
    ("abort", call_id)                    cancel that stream or call (frees its KV blocks)
    ("close",)
Child -> parent: ("ready", EngineFacts) or ("failed", exception) once, then
    (entries, EngineLoad) per loop turn, entries [(call_id, ok, value)]: a stream's
    first chunk as `head(out)`, later ones as (token_ids, text, finish_reason, index), and
    a timed stream's RequestTimes just before its last chunk; a call's result; or, when
    not ok, the exception to raise.

Messages are pickled by value (adapter tensors included), not through
multiprocessing's reducers: nothing is shared between the processes.
"""
from __future__ import annotations

import pickle
from array import array
from multiprocessing.connection import Connection
from typing import Any

from adapterserve.engine.request import RequestOutput

CALLS = frozenset({"classify", "embed", "add_adapter", "unload_adapter", "load", "stats"})


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(encode(message))


def recv(conn: Connection) -> Any:
    return decode(conn.recv_bytes())


def decode(payload: bytes) -> Any:
    return pickle.loads(payload)


def head(out: RequestOutput) -> tuple:
    """A stream's first chunk as it crosses: a plain tuple, its prompt ids packed as one
    buffer (a list of ints pickles, and unpickles, int by int: most of a burst's first
    chunks' cost)."""
    return (out.request_id, out.token_ids, out.text, out.finish_reason, out.adapter_id,
            array("q", out.prompt_token_ids), out.cached_tokens, out.index)


def output_of_head(fields: tuple) -> RequestOutput:
    """The RequestOutput that `head` packed."""
    request_id, token_ids, text, reason, adapter_id, prompt_ids, cached_tokens, index = fields
    return RequestOutput(request_id, token_ids, text, reason, adapter_id, prompt_ids.tolist(),
                         cached_tokens=cached_tokens, index=index)


def portable(exc: BaseException) -> BaseException:
    """`exc` if it crosses a pipe with its type and message intact, else a RuntimeError naming it."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc):
            return exc
    except Exception:
        pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")
