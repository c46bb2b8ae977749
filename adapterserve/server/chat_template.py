"""Chat prompts rendered with the generation backbone's own chat template (or the server's).

    renderer = ChatRenderer(tokenizer, override=None, model_id="llama-3.2-1b")
    ids = renderer.render([{"role": "user", "content": "Hi"}], ChatOptions())  # blocking: call in a thread

The template is the tokenizer's `chat_template` unless the server sets `chat_template`
(`--chat-template FILE`: a file, or the template itself). Rendering is transformers'
`apply_chat_template` (Jinja in a sandbox) with `add_generation_prompt` on by default;
its token ids come without added special tokens (the template writes them). Where the
tokenizer supports it, control tokens inside messages (`<|eot_id|>` typed by a user)
are encoded as plain text, so only the template writes control tokens.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapterserve.errors import RequestError

# names transformers gives every template (besides apply_chat_template's own parameters)
_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "raise_exception", "strftime_now"})


@dataclass(frozen=True)
class ChatOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra template variables


def resolve_chat_template(value: Any) -> str | None:
    """The config's `chat_template` as template text: a file's contents or the template itself
    (it holds '{{' or '{%'); None keeps the tokenizer's. ValueError if unreadable or not Jinja."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"chat_template must be a file path or a Jinja template, got {value!r}")
    text = value if ("{{" in value or "{%" in value) else _read(value)
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template is not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return text


def _read(path: str) -> str:
    file = Path(path).expanduser()
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template file {str(file)!r} cannot be read ({exc}); give a Jinja template "
                         "file (--chat-template FILE)") from None


class ChatRenderer:
    def __init__(self, tokenizer: Any, override: str | None, model_id: str) -> None:
        self.tokenizer, self.override, self.model_id = tokenizer, override, model_id
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters if tokenizer else {}
        self._sanitize = {"sanitize_control_tokens": True} if "sanitize_control_tokens" in parameters else {}
        self.reserved = (frozenset(parameters) | frozenset(getattr(tokenizer, "special_tokens_map", {}))
                         | _TEMPLATE_NAMES)

    def render(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> list[int]:
        """The prompt's token ids; RequestError if there is no template or it refuses the messages."""
        self._check_available()
        self._check_options(messages, options)
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], chat_template=self.override, tokenize=True, return_dict=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **self._sanitize,
                **dict(options.template_kwargs))
        except (TemplateError, ValueError, TypeError) as exc:  # raised by the template on these messages
            raise RequestError(f"the chat template of {self.model_id!r} refused these messages: {exc}") from None
        return list(ids)

    def _check_available(self) -> None:
        if self.tokenizer is None:
            raise RequestError(f"model {self.model_id!r} has no tokenizer, so chat completions are not available; "
                               "send /v1/completions with prompt token ids")
        if self.override is None and not self.tokenizer.chat_template:
            raise RequestError(f"model {self.model_id!r} has no chat template (its tokenizer sets none): the server "
                               "needs one (--chat-template FILE, config chat_template), or use /v1/completions "
                               "with a prompt formatted yourself")

    def _check_options(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> None:
        if options.continue_final_message:
            if options.add_generation_prompt:
                raise RequestError("'continue_final_message' needs 'add_generation_prompt' set to false")
            if messages[-1]["role"] != "assistant":
                raise RequestError("'continue_final_message' needs the last message to be the assistant's")
        taken = sorted(self.reserved.intersection(options.template_kwargs))
        if taken:
            raise RequestError(f"'chat_template_kwargs' may not set {', '.join(map(repr, taken))}: "
                               "the server sets those")
