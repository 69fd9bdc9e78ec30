"""CLI pieces: flags -> EdgeSettings, live text coloured by origin on a terminal, the JSONL round log."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from edge.cli import FLAG_FIELDS, PER_REQUEST, SERVE_ONLY, build_parser, flag_of, settings_from_args
from edge.draft_choice import with_cloud_draft
from edge.report import COLOURS, LOG_FIELDS, LiveText, summary_table, write_log
from edge.settings import EdgeSettings


def test_flags_override_settings_and_unset_flags_leave_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_EDGE_TOP_P", "0.5")
    args = build_parser().parse_args(["generate", "hi", "--grpc", "127.0.0.1:1", "--draft", "ngram", "--k", "4",
                                      "--temperature", "0", "--no-timeout-fallback", "--send-q-dists"])
    s = settings_from_args(args)
    assert s.grpc_target == "127.0.0.1:1" and s.draft == "ngram" and s.fixed_k == 4 and s.temperature == 0
    assert s.top_p == 0.5 and s.timeout_fallback is False and s.send_q_dists is True
    assert s.repetition_penalty == 1.1 and s.k_start == 6 and s.timeout_ms is None  # documented defaults


def test_the_drafts_threads_come_from_the_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECSPLIT_EDGE_THREADS sets PyTorch's threads as --threads does; the flag wins over it."""
    import torch

    from edge.cli import _set_threads

    before = torch.get_num_threads()
    monkeypatch.setenv("SPECSPLIT_EDGE_THREADS", "1")
    try:
        s = settings_from_args(build_parser().parse_args(["generate", "hi", "--draft", "ngram"]))
        assert s.threads == 1
        torch.set_num_threads(2)
        _set_threads(s)
        assert torch.get_num_threads() == 1
        flagged = settings_from_args(build_parser().parse_args(["generate", "hi", "--threads", "2"]))
        assert flagged.threads == 2
    finally:
        torch.set_num_threads(before)


class Letters:
    """A stand-in tokenizer client: token i decodes to chr(97 + i)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i) for i in ids)


def test_live_text_colours_each_token_by_origin_only_on_a_terminal() -> None:
    out = io.StringIO()
    live = LiveText(Letters(), out, colour=True)  # type: ignore[arg-type]
    for tok, origin in [(0, "accepted"), (1, "correction"), (2, "local")]:
        live.add(tok, origin)
    assert out.getvalue() == (f"{COLOURS['accepted']}a\x1b[0m{COLOURS['correction']}b\x1b[0m"
                              f"{COLOURS['local']}c\x1b[0m")
    plain = io.StringIO()
    live = LiveText(Letters(), plain, colour=False)  # type: ignore[arg-type]
    for tok in (0, 1, 2):
        live.add(tok, "bonus")
    assert plain.getvalue() == "abc"


def test_live_text_does_not_print_special_tokens() -> None:
    """An answer's end-of-turn token (the chat template's <|im_end|>) ends the text; it is not printed."""
    class WithSpecials(Letters):
        class tokenizer:  # noqa: N801
            all_special_ids = [25]

    out = io.StringIO()
    live = LiveText(WithSpecials(), out, colour=False)  # type: ignore[arg-type]
    for tok in (0, 1, 25):
        live.add(tok, "bonus")
    assert out.getvalue() == "ab"


def test_round_log_has_one_line_per_round_with_the_guide_fields(make_client: Any, tmp_path: Path) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=10)
    result = client.generate("x = 1\ny = 2\n")
    path = tmp_path / "log.jsonl"
    write_log(str(path), result)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len(result.rounds) and all(set(line) == set(LOG_FIELDS) for line in lines)
    table = summary_table(result)
    assert "acceptance rate" in table and "bytes up / down" in table


def test_without_draft_the_edge_drafts_with_the_model_that_speaks_the_clouds_tokenizer(
        tiny_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Two drafts under models/ with different tokenizers: the cloud's fingerprint picks one; a cloud that
    speaks neither, or does not answer, leaves the default with a warning line saying so; --draft always wins."""
    import shutil

    from transformers import AutoTokenizer

    import edge.settings
    from edge.transport.rest import RestTransport
    from shared.protocol import ModelInfo
    from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint

    models = tmp_path / "models"
    coder = models / "qwen2.5-coder-0.5b-instruct"
    shutil.copytree(tiny_pair[1], coder)
    other = models / "demo-draft"
    shutil.copytree(tiny_pair[1], other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_special_tokens({"additional_special_tokens": ["<|only-here|>"]})  # another tokenizer
    tok.save_pretrained(other)
    monkeypatch.setattr(edge.settings, "REPO_ROOT", tmp_path)
    fp = {d: tokenizer_fingerprint(load_tokenizer(d)) for d in (coder, other)}
    assert fp[coder] != fp[other]
    answer: list[Any] = []

    def get_model(self: RestTransport, timeout: float) -> ModelInfo:
        if not answer:
            from edge.transport.errors import CloudUnavailable
            raise CloudUnavailable("down")
        return ModelInfo(model_id="m", vocab_size=256, tokenizer_fingerprint=answer[0])

    monkeypatch.setattr(RestTransport, "get_model", get_model)
    monkeypatch.delenv("SPECSPLIT_EDGE_DRAFT", raising=False)
    def drafted(argv: list[str]) -> str:
        args = build_parser().parse_args(argv)
        return with_cloud_draft(settings_from_args(args), args).draft

    with caplog.at_level("WARNING", logger="edge.draft_choice"):
        default = drafted(["generate", "hi"])  # the cloud does not answer: one line says so
    assert "the cloud did not answer" in caplog.text and "--draft" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="edge.draft_choice"):  # no warning (another test may have left INFO on)
        for d in (other, coder):
            answer[:] = [fp[d]]
            assert settings_from_args(build_parser().parse_args(["generate", "hi"])).draft == default  # no I/O
            assert drafted(["generate", "hi"]) == str(d)
            assert drafted(["generate", "hi", "--draft", "ngram"]) == "ngram"
    assert not caplog.text
    answer[:] = ["0" * 16]
    with caplog.at_level("WARNING", logger="edge.draft_choice"):
        assert drafted(["generate", "hi"]) == default
    assert "no draft under models/ speaks the cloud's tokenizer" in caplog.text


def test_a_server_started_before_its_cloud_chooses_its_draft_at_the_first_answer(
        tiny_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` without --draft while the cloud is down: start-up leaves the choice to the first answer
    (cloud_draft_or_later), the server starts on the default draft, and the engine's first successful model
    info adopts the draft that speaks the cloud's tokenizer (settings, draft weights, tokenizer) before anything
    uses them; a failed first contact changes nothing, and --draft is never second-guessed. When a session
    later finds the cloud speaking another tokenizer (TokenizerChanged: restarted with another model), the next
    model info chooses again."""
    import shutil

    from transformers import AutoTokenizer

    import edge.settings
    from edge.draft_choice import cloud_draft_or_later
    from edge.exchange import TokenizerChanged
    from edge.server.serve import build_engine
    from edge.transport.errors import CloudUnavailable
    from edge.transport.rest import RestTransport
    from shared.protocol import ModelInfo
    from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint

    models = tmp_path / "models"
    coder, default = models / "qwen2.5-coder-0.5b-instruct", models / "demo-draft"
    shutil.copytree(tiny_pair[1], coder)
    shutil.copytree(tiny_pair[1], default)
    tok = AutoTokenizer.from_pretrained(default)
    tok.add_special_tokens({"additional_special_tokens": ["<|only-here|>"]})  # another tokenizer
    tok.save_pretrained(default)
    monkeypatch.setattr(edge.settings, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("SPECSPLIT_EDGE_DRAFT", raising=False)
    want = tokenizer_fingerprint(load_tokenizer(coder))
    first = want
    up: list[bool] = []

    def get_model(self: RestTransport, timeout: float) -> ModelInfo:
        if not up:
            raise CloudUnavailable("down")
        return ModelInfo(model_id="m", vocab_size=256, tokenizer_fingerprint=want)

    monkeypatch.setattr(RestTransport, "get_model", get_model)
    args = build_parser().parse_args(["serve", "--max-retries", "0", "--draft", str(default)])
    assert cloud_draft_or_later(settings_from_args(args), args)[1] is False  # --draft given: never chosen
    args = build_parser().parse_args(["serve", "--max-retries", "0"])
    settings, later = cloud_draft_or_later(settings_from_args(args), args)
    assert later and settings.draft == str(default)
    engine = build_engine(settings, choose_draft=True)
    assert engine.tokenizer.fingerprint != want
    with pytest.raises(CloudUnavailable):
        engine.model_info()
    assert engine.settings.draft == str(default) and engine.choose_draft  # still to be chosen
    up.append(True)
    engine.model_info()
    assert engine.settings.draft == str(coder) and engine.draft.settings.draft == str(coder)
    assert engine.tokenizer.fingerprint == want and not engine.choose_draft
    engine.check_ready()  # the adopted pair passes the pairing check
    assert engine.model_info().tokenizer_fingerprint == first  # kept: asked once
    want = tokenizer_fingerprint(load_tokenizer(default))  # the cloud comes back with the other model
    assert engine.model_info().tokenizer_fingerprint == first  # nothing has told the engine yet
    engine.forget_cloud(TokenizerChanged(first, want, 7))
    assert engine.model_info().tokenizer_fingerprint == want
    assert engine.settings.draft == str(default) and engine.tokenizer.fingerprint == want
    engine.check_ready()


def _subparser(command: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr,index,no-any-return]


def _options(command: str) -> set[str]:
    return {o for a in _subparser(command)._actions for o in a.option_strings}


def test_every_setting_a_doc_names_as_a_flag_is_a_flag_of_generate_and_serve() -> None:
    import re

    root = Path(__file__).resolve().parents[2]
    flags = {flag_of(n) for n in EdgeSettings.model_fields}
    named = {m for doc in [*root.glob("docs/*.md"), root / "README.md"]
             for m in re.findall(r"--[a-z][a-z0-9-]+", doc.read_text(encoding="utf-8"))} & flags
    assert "--max-retries" in named
    per_request = {flag_of(n) for n in PER_REQUEST}  # a server's OpenAI request fields
    assert named - per_request <= _options("serve"), named - per_request - _options("serve")
    serve_only = {flag_of(n) for n in SERVE_ONLY}  # a server's keys, request bodies and generations at once
    assert named - serve_only <= _options("generate"), named - serve_only - _options("generate")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_described_setting_is_a_flag_whose_help_gives_the_settings_default_once(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A described EdgeSettings field is a flag (serve's without the sampling a request carries, generate's without
    the server's own); the rest are not. Its help is the description, then the default read from EdgeSettings and
    its variable: the description names no default, and `--help` shows each default once. A field unset by default
    (None, or computed) says in its description what unset does."""
    by_dest = {a.dest: a for a in _subparser(command)._actions}
    leave_out = SERVE_ONLY if command == "generate" else PER_REQUEST
    assert {n for n in EdgeSettings.model_fields if n in by_dest} == set(FLAG_FIELDS) - leave_out
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in set(FLAG_FIELDS) - leave_out:
        field, action = EdgeSettings.model_fields[name], by_dest[name]
        assert flag_of(name) in action.option_strings and "default" not in (field.description or ""), name
        env = f"env SPECSPLIT_EDGE_{name.upper()}"
        d = None if field.default_factory is not None else field.default
        if d is None:
            assert "unset:" in (field.description or "") and env in text, name
            continue
        shown = ("on" if d else "off") if isinstance(d, bool) else str(d)
        assert text.count(f"(default {shown}; {env})") == 1, name
        assert " ".join(str(action.help).split()).count("default") == 1, name


def test_renamed_and_boolean_flags_keep_their_forms() -> None:
    """The flags whose name is not their field's, and --x / --no-x of the booleans, as docs and scripts call them."""
    args = build_parser().parse_args(["serve", "--cloud", "https://c:1", "--grpc", "c:2", "--k", "3", "--no-gating",
                                      "--grpc-tls", "--server-api-key", "a", "--server-api-key", "b"])
    s = settings_from_args(args)
    assert (s.cloud_url, s.grpc_target, s.fixed_k, s.gating, s.grpc_tls) == ("https://c:1", "c:2", 3, False, True)
    assert s.server_key_values() == ["a", "b"]
    assert build_parser().parse_args(["generate", "hi", "--no-tree-copy"]).tree_copy is False
    with pytest.raises(SystemExit):  # an environment-only setting is no flag
        build_parser().parse_args(["generate", "hi", "--t-nll", "1"])


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_max_retries_and_log_level_are_flags(command: list[str]) -> None:
    from edge.cli import log_level

    args = build_parser().parse_args([*command, "--draft", "ngram", "--max-retries", "2", "--log-level", "debug"])
    assert settings_from_args(args).max_retries == 2 and log_level(args) == "debug"
    quiet = build_parser().parse_args([*command, "--draft", "ngram"])
    assert log_level(quiet) == ("warning" if command[0] == "generate" else "info")
    assert log_level(build_parser().parse_args([*command, "-v"])) == "info"
