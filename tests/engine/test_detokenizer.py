"""Incremental detokenisation against decoding the whole output, on real tokenizer
kinds: WordPiece (all-MiniLM-L6-v2, with and without clean-up of spaces), byte-level
BPE (the tiny Llama checkpoint's) and SentencePiece-style BPE with byte fallback.

At every step the text equals tokenizer.decode(ids so far), and what may be streamed
is a prefix of the final decode; stop strings end requests as decoding everything did."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from adapterserve.engine.detokenizer import DecodeState, Detokenizer
from adapterserve.engine.request import Request, RequestStatus
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.engine.stopping import check_stop_token, stream_delta, update_text
from tests.helpers.tokenizers import sentencepiece_tokenizer

TEXT = ("The river runs past the old mill; don't stop. It's a café, naïve but warm: tea costs €5 "
        "or £4 — über straße, 東京 と 大阪 😀🚀 and the hikers follow the path up the hill. ")
KINDS = ["wordpiece", "wordpiece-cleanup", "bytelevel", "sp-strip", "sp-metaspace"]


@pytest.fixture(scope="module")
def tokenizers(llama_dir) -> dict:
    from adapterserve.models.encoder_loader import default_encoder_dir

    minilm = default_encoder_dir()
    return {
        "wordpiece": AutoTokenizer.from_pretrained(minilm),
        "wordpiece-cleanup": AutoTokenizer.from_pretrained(minilm, clean_up_tokenization_spaces=True),
        "bytelevel": AutoTokenizer.from_pretrained(llama_dir),
        "sp-strip": sentencepiece_tokenizer("strip"),
        "sp-metaspace": sentencepiece_tokenizer("metaspace"),
    }


def _byte_ids(tokenizer) -> list[int]:
    """Ids of single-byte tokens: byte fallback's <0xNN>, else byte-level BPE's alphabet."""
    fallback = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    if all(i is not None and i != tokenizer.unk_token_id for i in fallback):
        return fallback
    vocab = tokenizer.get_vocab()
    alphabet = _byte_alphabet()
    return [vocab[alphabet[b]] for b in range(256) if alphabet[b] in vocab]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b's character."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _natural(tokenizer) -> list[int]:
    return tokenizer(TEXT, add_special_tokens=False).input_ids


def _random(tokenizer, rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(len(tokenizer)) for _ in range(n)]


def _adversarial(tokenizer, rng: random.Random, n: int) -> list[int]:
    """Multi-byte characters split into byte tokens, cut short, lone continuation and
    invalid bytes, between runs of special tokens and ordinary ones."""
    byte_ids = _byte_ids(tokenizer)
    if len(byte_ids) < 256:
        return _random(tokenizer, rng, n)
    ordinary = _natural(tokenizer)
    ids: list[int] = []
    while len(ids) < n:
        raw = rng.choice(["€", "😀", "東京", "ï", "x"]).encode()
        kind = rng.random()
        if kind < 0.2:
            raw = raw[: rng.randrange(1, len(raw) + 1)]  # maybe cut short
        elif kind < 0.3:
            raw = bytes([rng.choice([0x80, 0xBF, 0xFF, 0xC0])])  # never valid alone
        ids += [byte_ids[b] for b in raw]
        if rng.random() < 0.3:
            ids += rng.choices(tokenizer.all_special_ids, k=rng.randint(1, 3))
        if rng.random() < 0.5:
            ids.append(rng.choice(ordinary))
    return ids[:n]


def _sequences(tokenizer, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return ([_natural(tokenizer)] + [_random(tokenizer, rng, 60) for _ in range(5)]
            + [_adversarial(tokenizer, rng, 60) for _ in range(10)])


@pytest.mark.parametrize("kind", KINDS)
def test_text_is_the_whole_decode_at_every_step(tokenizers, kind):
    tokenizer = tokenizers[kind]
    detok = Detokenizer(tokenizer)
    for seed, ids in enumerate(_sequences(tokenizer, seed=7)):
        final = detok.decode(ids)
        state = DecodeState()
        for k in range(len(ids) + 1):
            text = detok.text(state, ids[:k])
            assert text == detok.decode(ids[:k]), (kind, seed, k)
            if not detok.whole:
                assert final.startswith(text[: state.stable]), (kind, seed, k)
        assert text == final and not state.whole  # never fell back to decoding everything


@pytest.mark.parametrize("kind", KINDS)
def test_decode_is_the_tokenizers_own(tokenizers, kind):
    """Decoding through the Rust tokenizer directly (all but the clean-up kind) gives
    tokenizer.decode's text on every prefix, special ids and split characters included."""
    tokenizer = tokenizers[kind]
    detok = Detokenizer(tokenizer)
    assert (detok.backend is None) == (kind == "wordpiece-cleanup")
    for ids in _sequences(tokenizer, seed=11):
        for k in range(len(ids) + 1):
            assert detok.decode(ids[:k]) == tokenizer.decode(ids[:k], skip_special_tokens=True), (kind, k)


def test_only_the_clean_up_of_spaces_decodes_everything(tokenizers):
    assert [k for k in KINDS if Detokenizer(tokenizers[k]).whole] == ["wordpiece-cleanup"]


@pytest.mark.parametrize("kind", ["wordpiece", "bytelevel", "sp-strip", "sp-metaspace"])
def test_each_step_decodes_a_few_tokens(tokenizers, kind):
    tokenizer = tokenizers[kind]
    ids = (_natural(tokenizer) * 40)[:2000]
    detok = Detokenizer(tokenizer)
    decoded = []
    decode = detok.decode
    detok.decode = lambda window: decoded.append(len(window)) or decode(window)
    state = DecodeState()
    for k in range(1, len(ids) + 1):
        text = detok.text(state, ids[:k])
    assert text == decode(ids)
    assert max(decoded) <= 12 and sum(decoded) <= 6 * len(ids)  # the whole output each step: ~n^2 / 2


def _old_update_text(request: Request, tokenizer, stop_token: bool) -> bool:
    """update_text as it was: decode every output id each step."""
    ids = request.output_ids[:-1] if stop_token else request.output_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stops = request.sampling.stop
    if stops:
        hits = [i for s in stops if (i := text.find(s, max(0, request.emitted_chars - len(s)))) >= 0]
        if hits:
            request.text = text[: min(hits)]
            return True
    request.text = text
    return False


def _old_stream_delta(request: Request) -> tuple[list[int], str]:
    text = request.text
    end = len(text)
    if not request.finished:
        if text.endswith("\ufffd"):
            end = len(text.rstrip("\ufffd"))
        longest_stop = max((len(s) for s in request.sampling.stop), default=0)
        end = min(end, len(text) - max(longest_stop - 1, 0))
    end = max(end, request.emitted_chars)
    ids = request.output_ids[request.emitted_tokens :]
    delta = text[request.emitted_chars : end]
    request.emitted_tokens = len(request.output_ids)
    request.emitted_chars = end
    return ids, delta


def _serve(ids: list[int], sampling: SamplingParams, update, delta, decoder) -> tuple[list[str], Request]:
    """Feed ids to a request one step at a time as the engine does; the streamed chunks."""
    request = Request(prompt_ids=[1], sampling=sampling)
    chunks = []
    for token in ids:
        request.output_ids.append(token)
        stop_token = check_stop_token(request, ())
        stop_string = update(request, decoder, stop_token)
        if stop_token or stop_string or len(request.output_ids) == len(ids):
            request.status = RequestStatus.FINISHED
            request.finish_reason = "stop" if stop_token or stop_string else "length"
        chunks.append(delta(request)[1])
        if request.finished:
            break
    return chunks, request


def _stops(tokenizer, ids: list[int], rng: random.Random) -> tuple[str, ...]:
    """Stop strings from the decoded text, most spanning tokens."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if len(text) < 8:
        return ()
    starts = [rng.randrange(len(text) - 4) for _ in range(2)]
    return tuple(text[s : s + rng.randint(2, 4)] for s in starts)


@pytest.mark.parametrize("kind", KINDS)
def test_streams_and_stops_match_decoding_everything(tokenizers, kind):
    tokenizer = tokenizers[kind]
    detok = Detokenizer(tokenizer)
    rng = random.Random(3)
    byte_fallback = bool(detok.byte_ids)
    for ids in _sequences(tokenizer, seed=11):
        stop_ids = (rng.choice(ids),) if rng.random() < 0.3 else ()
        for stop in [(), _stops(tokenizer, ids[: rng.randint(4, len(ids))], rng)]:
            sampling = SamplingParams(max_tokens=len(ids), stop=stop, stop_token_ids=stop_ids)
            old_chunks, old = _serve(ids, sampling, _old_update_text, _old_stream_delta, tokenizer)
            chunks, new = _serve(ids, sampling, update_text, stream_delta, detok)
            assert (new.output_ids, new.finish_reason, new.text) == (old.output_ids, old.finish_reason, old.text)
            if not byte_fallback and not stop:  # else byte runs, and text a stop may yet take, wait
                assert chunks == old_chunks
            if not detok.whole:  # clean-up may rewrite what was streamed, as it did before
                assert "".join(chunks) == new.text


def test_a_stop_string_ending_in_a_split_character_is_never_streamed(tokenizers):
    tokenizer = tokenizers["bytelevel"]
    byte_ids = _byte_ids(tokenizer)
    ids = [byte_ids[b] for b in "ab東c".encode()]
    sampling = SamplingParams(max_tokens=len(ids), stop=("b東",))
    chunks, request = _serve(ids, sampling, update_text, stream_delta, Detokenizer(tokenizer))
    assert (request.text, "".join(chunks), request.finish_reason) == ("a", "a", "stop")
    old_chunks, _ = _serve(ids, sampling, _old_update_text, _old_stream_delta, tokenizer)
    assert "".join(old_chunks) == "ab"  # held back one character, not counting the unfinished one
