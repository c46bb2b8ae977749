"""Prompts tokenized and length-checked at the ingress, so the engine gets token ids.

A text prompt is first held to a cheap character cap (`max_prompt_chars`; by default
CHARS_PER_TOKEN characters per token of the backbone's max_model_len: a text that long
cannot fit however it tokenizes, short of a vocabulary of very long tokens), then
tokenized in a worker thread with the backbone's own tokenizer, as the engine would.
Token ids, given or made, are checked against the vocabulary, and the prompt (with an
adapter's virtual tokens) plus max_tokens against max_model_len. Tokenizing a long
prompt thus costs one ingress thread, never the engine's step loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from threading import Thread

from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.request_fields import plain_ids

CHARS_PER_TOKEN = 32
_loading: dict[str, Future] = {}  # model dir -> its tokenizer, loading in a thread of its own


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    max_prompt_chars: int  # a longer text prompt is refused before it is tokenized


def start_loading_tokenizer(model_dir: str | Path) -> None:
    """Begin load_tokenizer(model_dir) in a thread, so that a replica loads it while its engine
    process starts; the next load_tokenizer of that directory takes the result."""
    future: Future = Future()
    _loading[str(model_dir)] = future

    def load() -> None:
        try:
            future.set_result(_read_tokenizer(model_dir))
        except BaseException as exc:  # handed to load_tokenizer
            future.set_exception(exc)

    Thread(target=load, name="adapterserve-tokenizer", daemon=True).start()


def load_tokenizer(model_dir: str | Path):
    """The backbone's tokenizer from its own files (never a download); None if it has none."""
    future = _loading.pop(str(model_dir), None)
    return future.result() if future is not None else _read_tokenizer(model_dir)


def _read_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError):
        return None


def limits_of(static: dict, max_prompt_chars: int | None) -> PromptLimits:
    """Limits from a replica's describe()["static"] facts; max_prompt_chars None = the default."""
    max_model_len = int(static["max_model_len"])
    return PromptLimits(int(static["vocab_size"]), max_model_len, max_prompt_chars or CHARS_PER_TOKEN * max_model_len)


async def prompt_token_ids(prompt: str | Sequence[int], tokenizer, limits: PromptLimits, max_tokens: int,
                           virtual_tokens: int = 0) -> list[int]:
    """The prompt's token ids; RequestError (RequestTooLarge for an over-long text) says what is wrong."""
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise RequestTooLarge(f"prompt has {len(prompt)} characters; this server takes at most "
                                  f"{limits.max_prompt_chars} (max_prompt_chars) before tokenizing")
        if tokenizer is None:
            raise RequestError("this backbone has no tokenizer: send prompt token ids")
        ids = await asyncio.to_thread(lambda: list(tokenizer(prompt).input_ids))
    else:
        ids = list(prompt)
        check_token_ids(ids, limits.vocab_size)
    if not ids:
        raise RequestError("prompt is empty")
    check_length(len(ids), virtual_tokens, max_tokens, limits.max_model_len)
    return ids


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    if plain_ids(ids, vocab_size):
        return
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise RequestError(f"prompt token id {token!r} at position {position} is not in [0, {vocab_size}) "
                               "(this backbone's vocabulary)")


def check_length(prompt_tokens: int, virtual_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """prompt (+ an adapter's virtual tokens) + max_tokens must fit max_model_len."""
    total = prompt_tokens + virtual_tokens + max_tokens
    if total <= max_model_len:
        return
    virtual = f" + {virtual_tokens} virtual tokens of the adapter" if virtual_tokens else ""
    raise RequestError(f"prompt has {prompt_tokens} tokens{virtual} and max_tokens is {max_tokens}: {total} is over "
                       f"this server's max_model_len of {max_model_len}; shorten the prompt or lower max_tokens")
