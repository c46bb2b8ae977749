"""Incremental detokenisation: a request's text after each new token, decoding a few
tokens per step however long the output (decoding all of it costs O(n) a token).

The text is always what ``tokenizer.decode(ids, skip_special_tokens=True)`` gives.
Rather than decode every id each step, decode a window (as vLLM and TGI do): the last
settled piece's tokens, for context, then the unsettled ones. The new text is what
the window gives beyond the context's own text, so effects that depend on where
decoding starts (SentencePiece strips the first leading space, WordPiece keeps the
first "##") fall on both alike. A piece settles, and the window moves past it, once
its text is final: it does not end in an incomplete UTF-8 sequence (U+FFFD), nor
inside a run of byte-fallback tokens ``<0xNN>``, which decode as a whole (one invalid
byte turns the whole run into U+FFFD).

A decoder that rewrites text behind the window (transformers'
``clean_up_tokenization_spaces``) gets the whole output decoded each step, as before;
so does a request whose window ever stops extending its context's text.
"""
from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what decoding gives for bytes that are not (yet) UTF-8


@dataclass
class DecodeState:
    """How far one request's output is decoded."""

    settled: str = ""  # text of ids[:read_offset]; no later token changes it
    context: str = ""  # the text of ids[prefix_offset:read_offset] when decoded from prefix_offset
    prefix_offset: int = 0  # where the window starts: the last settled piece
    read_offset: int = 0  # ids settled
    stable: int = 0  # characters of the current text that no later token changes
    whole: bool = False  # decode all ids each step (the decoder reached behind the window)


class Detokenizer:
    """Decodes outputs incrementally with one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_ids = byte_fallback_ids(tokenizer)
        self.special_ids = special_ids(tokenizer)
        self.whole = cleans_up_spaces(tokenizer)
        self.backend = None if self.whole else plain_backend(tokenizer)

    def decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self, state: DecodeState, ids: list[int]) -> str:
        """The text of ``ids``: those of the last call on ``state``, with any new at the end."""
        if self.whole or state.whole:
            text = self.decode(ids)
            state.stable = len(text.rstrip(REPLACEMENT))
            return text
        window = self.decode(ids[state.prefix_offset :])
        if not window.startswith(state.context):
            state.whole = True
            return self.text(state, ids)
        tail = window[len(state.context) :]
        open_run = self._ends_in_byte_run(ids)
        if tail and not open_run and not tail.endswith(REPLACEMENT):
            state.settled += tail
            state.prefix_offset, state.read_offset = state.read_offset, len(ids)
            state.context = self.decode(ids[state.prefix_offset : state.read_offset])
            tail = ""
        state.stable = len(state.settled) + (0 if open_run else len(tail.rstrip(REPLACEMENT)))
        return state.settled + tail if tail else state.settled

    def _ends_in_byte_run(self, ids: list[int]) -> bool:
        """Whether the last id that decoding keeps (it skips special ones) is a byte token."""
        if self.byte_ids:
            for token in reversed(ids):
                if token not in self.special_ids:
                    return token in self.byte_ids
        return False


def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's byte tokens <0x00>..<0xFF> (SentencePiece byte fallback)."""
    names = [f"<0x{b:02X}>" for b in range(256)]
    ids = tokenizer.convert_tokens_to_ids(names)
    return frozenset(i for i, name in zip(ids, names)
                     if i is not None and tokenizer.convert_ids_to_tokens(i) == name)


def special_ids(tokenizer) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) leaves out."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def cleans_up_spaces(tokenizer) -> bool:
    """Whether decode rewrites spaces across tokens ("a ' b" -> "a'b"): transformers'
    clean_up_tokenization_spaces, which transformers 5 skips for BPE models."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    ids = tokenizer.encode("a ' b . c n't", add_special_tokens=False)
    return tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def plain_backend(tokenizer) -> object | None:
    """The Rust tokenizer under a transformers fast tokenizer whose decode adds nothing to
    the Rust one's (no clean-up of spaces, no decode of its own): the same text without
    transformers' per-call conversions of the ids. None for any other tokenizer."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or not isinstance(backend, Tokenizer)
            or kind.decode is not TokenizersBackend.decode or kind._decode is not TokenizersBackend._decode):
        return None
    bpe = type(backend.model).__name__ == "BPE"
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and (forced or not bpe):
        return None
    return backend
