"""After each new token: update the request's text and decide whether it is done."""
from __future__ import annotations

from adapterserve.engine.detokenizer import Detokenizer
from adapterserve.engine.request import Request


def check_stop_token(request: Request, eos_ids: tuple[int, ...]) -> bool:
    params = request.sampling
    token = request.output_ids[-1]
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids)


def update_text(request: Request, detokenizer: Detokenizer | None, stop_token: bool) -> bool:
    """Bring the request's text up to its newest token; True if a stop string ended it
    (text cut there). A stop token never appears in the text; nor does a stop string
    or what follows it.
    """
    if detokenizer is None:
        return False
    ids = request.output_ids[:-1] if stop_token else request.output_ids
    text = detokenizer.text(request.decoded, ids)
    stops = request.sampling.stop
    if stops:
        hits = [i for s in stops if (i := text.find(s, max(0, request.emitted_chars - len(s)))) >= 0]
        if hits:
            request.text = text[: min(hits)]
            return True
    request.text = text
    return False


def stream_delta(request: Request) -> tuple[list[int], str]:
    """Token ids and text not yet streamed. While running, text that later tokens may
    still change is held back, and so is what may yet begin a stop string."""
    outputs, text, emitted = request.output_ids, request.text, request.emitted_chars
    if request.finished:
        end = len(text)
    else:
        stops = request.sampling.stop
        end = request.decoded.stable - (max(max(map(len, stops)) - 1, 0) if stops else 0)
    ids = outputs[request.emitted_tokens :]
    request.emitted_tokens = len(outputs)
    if end <= emitted:
        return ids, ""
    request.emitted_chars = end
    return ids, text[emitted:end]
