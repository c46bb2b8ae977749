"""SentencePiece-style tokenizers with byte fallback, as Llama 2 and Mistral convert to
Hugging Face's format, trained here on a small corpus (nothing to download)."""
from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "the river runs past the old mill and the hikers follow the path up the hill",
    "don't stop. it's a café, naïve but warm; tea costs €5 or £4",
    "über straße — 東京 と 大阪",
] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_tokenizer(decoder: str = "strip") -> PreTrainedTokenizerFast:
    """A BPE with byte fallback and "▁" for spaces. decoder "strip": Llama 2's (the first
    leading space stripped from the whole text); "metaspace": the Metaspace decoder
    (the first token's "▁" dropped), as newer conversions use."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if decoder == "strip":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    elif decoder == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", "first", split=False)])
    else:
        raise ValueError(f"decoder must be 'strip' or 'metaspace', got {decoder!r}")
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=160, special_tokens=SPECIALS, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=_with_bytes(tok), bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _with_bytes(tok: Tokenizer) -> Tokenizer:
    """The trained tokenizer with <0x00>..<0xFF> as ordinary tokens after the special
    ones (ids 3..258), as in Llama 2's vocabulary."""
    spec = json.loads(tok.to_str())
    trained = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(SPECIALS + BYTES + trained)}
    for added in spec["added_tokens"]:
        added["id"] = SPECIALS.index(added["content"])
    return Tokenizer.from_str(json.dumps(spec))
