"""OpenAI request bodies: defaults, the accepted forms, and 400s that name the unsupported field."""

from __future__ import annotations

from typing import Any

import pytest

from edge.server.openai_bodies import ChatCompletionBody, CompletionBody
from edge.server.openai_errors import OpenAIError, from_specsplit
from edge.transport.errors import CloudUnavailable
from shared.config import SamplingConfig
from shared.errors import InvalidArgument, ResourceExhausted, SpecSplitError


def completion(**kw: Any) -> CompletionBody:
    return CompletionBody.model_validate({"model": "m", "prompt": "hi", **kw})


def chat(**kw: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_openai_defaults_temperature_one_and_no_filters_or_penalty() -> None:
    assert completion().sampling() == SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    assert completion().max_new_tokens() == 16  # OpenAI's completions default
    body = completion(temperature=0, top_p=0.5, top_k=-1, repetition_penalty=1.2, max_tokens=7)
    assert body.sampling() == SamplingConfig(temperature=0, top_p=0.5, top_k=0, repetition_penalty=1.2)
    assert body.max_new_tokens() == 7


def test_prompt_forms_a_string_a_list_of_one_and_token_ids() -> None:
    assert completion(prompt=["one"]).prompt_value() == "one"
    assert completion(prompt=[5, 6]).prompt_value() == [5, 6]
    assert completion(prompt=[[5, 6]]).prompt_value() == [5, 6]
    with pytest.raises(OpenAIError) as err:
        completion(prompt=["one", "two"]).prompt_value()
    assert err.value.status == 400 and err.value.param == "prompt"


def test_stop_is_a_string_or_a_list_of_at_most_four_non_empty_strings() -> None:
    assert completion(stop="x").stop_sequences() == ("x",)
    assert completion(stop=["x", "y"]).stop_sequences() == ("x", "y")
    assert completion().stop_sequences() == ()
    for bad in (["a", "b", "c", "d", "e"], ""):
        with pytest.raises(OpenAIError) as err:
            completion(stop=bad).stop_sequences()
        assert err.value.param == "stop"


@pytest.mark.parametrize("field,value", [("n", 2), ("best_of", 2), ("echo", True), ("logprobs", 0),
                                         ("presence_penalty", 0.1), ("frequency_penalty", -1.0),
                                         ("logit_bias", {"5": 1.0}), ("suffix", "end")])
def test_unsupported_completion_fields_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(OpenAIError) as err:
        completion(**{field: value}).check()
    assert (err.value.status, err.value.param, err.value.code) == (400, field, "unsupported_parameter")
    assert field in err.value.message


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    completion(n=1, best_of=1, echo=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
               user="u").check()
    chat(n=1, logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"},
         parallel_tool_calls=True).check()


@pytest.mark.parametrize("field,value", [("logprobs", True), ("top_logprobs", 2), ("tools", [{"type": "function"}]),
                                         ("response_format", {"type": "json_object"})])
def test_unsupported_chat_fields_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(OpenAIError) as err:
        chat(**{field: value}).check()
    assert err.value.param == field


def test_chat_messages_text_parts_and_the_newer_max_completion_tokens() -> None:
    body = chat(messages=[{"role": "system", "content": "s"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "c", "refusal": None, "tool_calls": None}],
                max_tokens=5, max_completion_tokens=9)
    assert [(m.role, m.content) for m in body.chat_messages()] == [("system", "s"), ("user", "ab"), ("assistant", "c")]
    assert body.max_new_tokens(default=128) == 9
    assert chat().max_new_tokens(default=128) == 128
    with pytest.raises(OpenAIError) as err:
        chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]).chat_messages()
    assert err.value.param == "messages[0].tool_calls"


def test_stream_options_need_stream() -> None:
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage() is True
    with pytest.raises(OpenAIError) as err:
        completion(stream_options={"include_usage": True}).include_usage()
    assert err.value.param == "stream_options"


@pytest.mark.parametrize("err,status,kind", [
    (InvalidArgument("prompt too long"), 400, "invalid_request_error"),
    (ResourceExhausted("queue full"), 429, "rate_limit_error"),
    (CloudUnavailable("refused"), 503, "service_unavailable"),
    (SpecSplitError("boom"), 500, "server_error"),
])
def test_project_errors_map_to_openai_statuses(err: SpecSplitError, status: int, kind: str) -> None:
    mapped = from_specsplit(err)
    assert (mapped.status, mapped.type) == (status, kind)
    assert set(mapped.to_body()["error"]) == {"message", "type", "param", "code"}
