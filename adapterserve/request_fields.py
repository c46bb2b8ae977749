"""Type and range checks for request fields, shared by the library, gRPC and HTTP.

Each check returns the value normalised (an int, a float, a tuple) or raises
RequestError naming the field and showing a short form of the bad value:

    integer("max_tokens", "5", 1, 100)  ->  RequestError("'max_tokens' must be an integer, got '5'")

bool is not an integer here, and numbers are finite. Integer types other than
int (numpy's, say) pass as ints; strings never pass as numbers.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from adapterserve.errors import RequestError, RequestTooLarge

MAX_SHOWN_CHARS = 60  # of a bad value's repr in an error message
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 (gRPC); the engine checks them against the vocabulary
MAX_PROMPT_CHARS = 1 << 20  # characters of a prompt text: more than a 128k-token context holds
MAX_PROMPT_IDS = 1 << 20  # token ids of a prompt (the engine then checks them against max_model_len)
MAX_TEXT_CHARS = 1 << 16  # characters of one Classify/Embed text: the encoder reads at most 512 tokens


def short(value: Any) -> str:
    """repr(value), cut to MAX_SHOWN_CHARS (a huge int is described, not printed)."""
    try:
        shown = repr(value)
    except ValueError:  # an int over Python's digit limit for str()
        return f"an integer of {value.bit_length()} bits"
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[: MAX_SHOWN_CHARS - 3] + "..."


def is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(name: str, value: Any, low: int, high: int) -> int:
    if not is_integer(value):
        raise RequestError(f"{name!r} must be an integer, got {short(value)}")
    if not low <= value <= high:
        raise RequestError(f"{name!r} must be between {low} and {high}, got {short(value)}")
    return int(value)


def number(name: str, value: Any, low: float, high: float) -> float:
    """A finite int or float in [low, high], as a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RequestError(f"{name!r} must be a number, got {short(value)}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float's range
        as_float = math.inf
    if not math.isfinite(as_float):
        raise RequestError(f"{name!r} must be a finite number, got {short(value)}")
    if not low <= as_float <= high:
        wanted = f"at least {low:g}" if high == math.inf else f"between {low:g} and {high:g}"
        raise RequestError(f"{name!r} must be {wanted}, got {short(value)}")
    return as_float


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name!r} must be true or false, got {short(value)}")
    return value


def text(name: str, value: Any, max_chars: int, *, too_long: type[RequestError] = RequestError) -> str:
    """A non-empty string of at most max_chars characters (else `too_long`: RequestTooLarge for
    prompts and texts, which a size limit refuses, a plain RequestError for small fields)."""
    if not isinstance(value, str):
        raise RequestError(f"{name!r} must be a string, got {short(value)}")
    if not value:
        raise RequestError(f"{name!r} is empty")
    if len(value) > max_chars:
        raise too_long(f"{name!r} has {len(value)} characters; this server takes at most {max_chars}")
    return value


def sequence(name: str, value: Any, max_items: int, what: str = "a list", *,
             too_long: type[RequestError] = RequestError) -> Sequence[Any]:
    """A list or tuple (not a string, not a mapping) of at most max_items items."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RequestError(f"{name!r} must be {what}, got {short(value)}")
    if len(value) > max_items:
        raise too_long(f"{name!r} has {len(value)} items; at most {max_items} are allowed")
    return value


def token_ids(name: str, value: Any, max_items: int, *, allow_empty: bool = False,
              too_long: type[RequestError] = RequestError) -> tuple[int, ...]:
    """Token ids in [0, MAX_TOKEN_ID]; the engine checks them against its vocabulary."""
    ids = sequence(name, value, max_items, "a list of token ids", too_long=too_long)
    if not ids and not allow_empty:
        raise RequestError(f"{name!r} is empty")
    if plain_ids(ids, MAX_TOKEN_ID + 1):
        return tuple(ids)
    for i, t in enumerate(ids):  # the first bad id, for the message; or ids of other integer types
        if not is_integer(t) or not 0 <= t <= MAX_TOKEN_ID:
            raise RequestError(f"'{name}[{i}]' must be a token id (an integer from 0 to {MAX_TOKEN_ID}), "
                               f"got {short(t)}")
    return tuple(int(t) for t in ids)


def plain_ids(ids: Sequence[Any], end: int) -> bool:
    """Whether every id is an int (not a bool, not another integer type) in [0, end), checked
    in C: a long prompt's ids are not looped over in Python at a request's start."""
    return not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < end)


def prompt(name: str, value: Any) -> str | list[int]:
    """A prompt: non-empty text of at most MAX_PROMPT_CHARS characters, or at most
    MAX_PROMPT_IDS token ids (RequestTooLarge if longer)."""
    if isinstance(value, str):
        return text(name, value, MAX_PROMPT_CHARS, too_long=RequestTooLarge)
    if isinstance(value, (list, tuple)):
        return list(token_ids(name, value, MAX_PROMPT_IDS, too_long=RequestTooLarge))
    raise RequestError(f"{name!r} must be a string or a list of token ids, got {short(value)}")
