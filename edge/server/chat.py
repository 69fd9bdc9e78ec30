"""Chat messages -> one prompt string, with a Jinja chat template (the tokenizer's own or a file's).

The template is rendered the way Hugging Face tokenizers render theirs: variables `messages`
(a list of {"role", "content"}), `add_generation_prompt` (True: end with the assistant's turn
opener) and the tokenizer's special tokens (`bos_token`, `eos_token`). The rendered text already
holds whatever special tokens the template wants, so it is tokenized without adding more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import InvalidArgument

HOW_TO_PASS = ("this model's tokenizer has no chat template: start the server with --chat-template FILE "
               "(a Jinja template over `messages`, `add_generation_prompt`), or use /v1/completions")


class NoChatTemplate(InvalidArgument):
    """A chat request to a server without a chat template."""


@dataclass(frozen=True)
class ChatMessage:
    # "system", "developer", "user" or "assistant"
    role: str
    # the message text
    content: str


class ChatTemplate:
    """A compiled Jinja chat template with the tokenizer's special tokens bound."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:  # templates call it to reject a conversation
            raise InvalidArgument(f"chat template: {message}")

        # the environment Hugging Face renders tokenizer templates in, so theirs work unchanged here
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Any = None) -> ChatTemplate:
        return cls(Path(path).read_text(encoding="utf-8"), special_tokens_of(tokenizer))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate | None:
        """The tokenizer's own template (a string, or a dict whose "default" entry is used); None without."""
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):
            source = source.get("default")
        return cls(source, special_tokens_of(tokenizer)) if isinstance(source, str) and source else None

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError

        if not messages:
            raise InvalidArgument("messages must hold at least one message")
        try:
            return self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except TemplateError as e:
            raise InvalidArgument(f"chat template failed on these messages: {e}") from None


def special_tokens_of(tokenizer: Any) -> dict[str, str]:
    """bos_token / eos_token / unk_token / pad_token strings the tokenizer defines."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    found = {n: getattr(tokenizer, n, None) for n in names} if tokenizer is not None else {}
    return {n: str(v) for n, v in found.items() if isinstance(v, str)}


def load_chat_template(path: str | Path | None, tokenizer: Any) -> ChatTemplate | None:
    """--chat-template FILE when given, else the tokenizer's template, else None."""
    if path:
        return ChatTemplate.from_file(path, tokenizer)
    return ChatTemplate.from_tokenizer(tokenizer)


def require(template: ChatTemplate | None) -> ChatTemplate:
    if template is None:
        raise NoChatTemplate(HOW_TO_PASS)
    return template
