"""Request bodies of the OpenAI-compatible routes (pydantic, at the REST boundary only).

Fields follow the OpenAI API reference. `top_k` and `repetition_penalty` are accepted as extra
sampling fields, as vLLM accepts them. A field we do not implement is accepted only at its neutral
value (`n` = 1, `echo` false, penalties 0, ...); any other value is a 400 naming the field, and so
is a field OpenAI does not define. `user`, `metadata`, `store` and `service_tier` are accepted and
ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from shared.config import SamplingConfig

from .chat import ChatMessage
from .openai_errors import invalid

# the longest list of stop sequences, as in OpenAI's API
MAX_STOP_SEQUENCES = 4
# completions without max_tokens write this many tokens (OpenAI's documented default)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _only(*values: Any) -> Any:
    """A field accepted at these values alone (`check_supported` refuses the others with a 400 naming it): said
    in the schema too."""
    return Field(default=None, json_schema_extra={"enum": [*values, None]})


def _neutral(value: Any) -> bool:
    """None, False, 0, 1-for-counts, empty containers: values that ask for nothing."""
    return value is None or value is False or value == 0 or value == {} or value == []


# field -> (is this value one we can honour?, what to say otherwise)
_COMMON_UNSUPPORTED: dict[str, Any] = {
    "n": lambda v: v is None or v == 1,
    "presence_penalty": _neutral,
    "frequency_penalty": _neutral,
    "logit_bias": _neutral,
    "logprobs": lambda v: v is None or v is False,
}
_COMPLETION_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "best_of": lambda v: v is None or v == 1,
    "echo": _neutral,
    "suffix": lambda v: v is None or v == "",
}
_CHAT_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "top_logprobs": _neutral,
    "tools": _neutral,
    "tool_choice": lambda v: v is None or v == "none",
    "functions": _neutral,
    "function_call": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None or v is True,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _neutral,
    "prediction": _neutral,
    "reasoning_effort": _neutral,
    "web_search_options": _neutral,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # true: one more chunk before [DONE] with `usage` (and `choices` empty)
    include_usage: StrictBool = False


def reject_lone_surrogates(value: Any, where: str) -> None:
    """A 400 naming the first string (or key) under `value` that holds a lone UTF-16 surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(f"{where or 'the body'} holds a lone surrogate (U+D800..U+DFFF), which is not text; "
                          "send valid UTF-8", where or None, "invalid_text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            reject_lone_surrogates(key, where)
            reject_lone_surrogates(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            reject_lone_surrogates(item, f"{where}[{i}]")


class GenerationBody(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")
    model: str
    # OpenAI: 0 to 2, default 1; 0 is greedy
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # a fixed seed makes the text reproducible; without one a fresh seed is drawn per request
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    # at most 4 sequences, none empty (`stop_sequences`: a 400 naming the field)
    stop: str | list[str] | None = Field(default=None, json_schema_extra={
        "maxItems": MAX_STOP_SEQUENCES, "minLength": 1, "items": {"type": "string", "minLength": 1}})
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # extra sampling fields (vLLM's): 0 or -1 disables top-k; 1.0 disables the penalty
    top_k: StrictInt | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    # accepted only at their neutral values (see the module docstring)
    n: StrictInt | None = _only(1)
    presence_penalty: float | None = _only(0)
    frequency_penalty: float | None = _only(0)
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra={"maxProperties": 0})
    # accepted and ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=max(self.top_k or 0, 0),
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)

    def stop_sequences(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid(f"stop holds {len(stops)} sequences; at most {MAX_STOP_SEQUENCES}", "stop")
        if any(s == "" for s in stops):
            raise invalid("stop sequences must not be empty", "stop")
        return tuple(stops)

    def include_usage(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_text(self) -> None:
        """Every string of the body must be text: a lone surrogate (JSON's "\\ud800") is a 400 naming the field."""
        reject_lone_surrogates(self.model_dump(), "")

    def check_supported(self, unsupported: dict[str, Any]) -> None:
        for name, ok in unsupported.items():
            value = getattr(self, name, None)
            if not ok(value):
                raise invalid(f"{name}={value!r} is not supported by this server", name, "unsupported_parameter")


class CompletionBody(GenerationBody):
    # a string, a list of one string, token ids, or a list of one list of token ids
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # accepted only at their neutral values
    best_of: StrictInt | None = _only(1)
    echo: StrictBool | None = _only(False)
    logprobs: StrictInt | None = _only()
    suffix: str | None = _only("")

    def check(self) -> None:
        self.check_text()
        self.check_supported(_COMPLETION_UNSUPPORTED)

    def prompt_value(self) -> str | list[int]:
        """The one prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if len(p) == 1 and isinstance(p[0], (str, list)):
            return p[0]
        if p and all(isinstance(t, int) for t in p):
            return [int(t) for t in p]  # type: ignore[arg-type]
        raise invalid(f"prompt must be one string or one list of token ids; got a list of {len(p)} prompts "
                      "(batched prompts are not supported)", "prompt")

    def max_new_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class MessageBody(BaseModel):
    # the SDK's own response messages may be sent back with refusal / annotations / audio fields
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_message(self, index: int) -> ChatMessage:
        for field in ("tool_calls", "function_call", "audio"):
            if (self.model_extra or {}).get(field):
                raise invalid(f"messages[{index}].{field} is not supported by this server",
                              f"messages[{index}].{field}", "unsupported_parameter")
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return ChatMessage(role=self.role, content=content or "")


class ChatCompletionBody(GenerationBody):
    messages: list[MessageBody] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # the newer name of max_tokens; wins when both are given
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    # accepted only at their neutral values
    logprobs: StrictBool | None = _only(False)
    top_logprobs: StrictInt | None = _only(0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_text()
        self.check_supported(_CHAT_UNSUPPORTED)

    def chat_messages(self) -> list[ChatMessage]:
        return [m.to_message(i) for i, m in enumerate(self.messages)]

    def max_new_tokens(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return default if self.max_tokens is None else self.max_tokens
