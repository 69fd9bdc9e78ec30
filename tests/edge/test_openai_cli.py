"""`specsplit-edge serve` flags and `generate --chat`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge.cli import build_parser, chat_prompt, settings_from_args
from edge.server.chat import NoChatTemplate


def test_serve_takes_the_edge_options_and_its_own_but_not_per_request_sampling() -> None:
    args = build_parser().parse_args(["serve", "--cloud", "http://c:1", "--draft", "ngram", "--k", "5",
                                      "--no-timeout-fallback", "--chat-template", "t.jinja", "--port", "9000",
                                      "--served-model-name", "mine"])
    s = settings_from_args(args)
    assert (s.cloud_url, s.draft, s.fixed_k, s.timeout_fallback) == ("http://c:1", "ngram", 5, False)
    assert (args.host, args.port, args.chat_template, args.served_model_name) == ("127.0.0.1", 9000, "t.jinja",
                                                                                   "mine")
    with pytest.raises(SystemExit):  # temperature and the rest come with each request
        build_parser().parse_args(["serve", "--temperature", "0"])


def test_generate_chat_sends_the_prompt_through_the_template(tiny_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("<|{{ messages[0].role }}|>{{ messages[0].content }}<|assistant|>")
    args = build_parser().parse_args(["generate", "hello there", "--chat", "--chat-template", str(path)])
    ids = chat_prompt(tiny_tokenizer, args)
    assert ids == tiny_tokenizer.encode("<|user|>hello there<|assistant|>", add_special_tokens=False)
    no_template = build_parser().parse_args(["generate", "hi", "--chat"])
    with pytest.raises(NoChatTemplate, match="--chat-template"):
        chat_prompt(tiny_tokenizer, no_template)


def test_generate_help_says_where_its_sampling_defaults_differ_from_serves(
        capsys: pytest.CaptureFixture[str]) -> None:
    """generate samples at EdgeSettings' top-p and repetition penalty, serve at OpenAI's (1.0 each, a request's
    body without them): generate's --help names both and why."""
    from edge.server.openai_bodies import CompletionBody
    from edge.settings import EdgeSettings

    served = CompletionBody(model="m", prompt="x").sampling()
    mine = EdgeSettings.model_fields
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, field, theirs in (("--top-p", "top_p", served.top_p),
                                ("--repetition-penalty", "repetition_penalty", served.repetition_penalty)):
        assert mine[field].default != theirs
        help_text = text.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert f"serve's requests take OpenAI's {theirs} when they leave it out" in help_text, flag
        assert f"(default {mine[field].default}; env SPECSPLIT_EDGE_{field.upper()})" in help_text, flag
