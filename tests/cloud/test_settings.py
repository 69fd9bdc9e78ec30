"""Settings: env prefix, flags over env, validation at start with a clear message and exit code."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cloud.cli import main, settings_from_args
from cloud.settings import CloudSettings


def test_environment_is_read_with_the_prefix(monkeypatch: pytest.MonkeyPatch, tiny_pair: tuple[Path, Path]) -> None:
    monkeypatch.setenv("SPECSPLIT_CLOUD_MODEL", str(tiny_pair[0]))
    monkeypatch.setenv("SPECSPLIT_CLOUD_MAX_K", "7")
    monkeypatch.setenv("SPECSPLIT_CLOUD_API_KEYS", '["a", "b"]')
    s = CloudSettings()  # type: ignore[call-arg]
    assert s.model == tiny_pair[0] and s.max_k == 7 and s.api_key_values() == ["a", "b"]


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch, tiny_pair: tuple[Path, Path]) -> None:
    monkeypatch.setenv("SPECSPLIT_CLOUD_MAX_K", "7")
    monkeypatch.setenv("SPECSPLIT_CLOUD_HTTP_PORT", "9000")
    s = settings_from_args(["--model", str(tiny_pair[0]), "--max-k", "5", "--api-key", "x", "--api-key", "y",
                            "--dtype", "bfloat16"])
    assert s.max_k == 5 and s.http_port == 9000 and s.api_key_values() == ["x", "y"] and s.dtype == "bfloat16"


def test_api_keys_are_not_shown_in_the_settings_repr(tiny_pair: tuple[Path, Path]) -> None:
    s = CloudSettings(model=tiny_pair[0], api_keys=["very-secret"])  # type: ignore[list-item]
    assert "very-secret" not in repr(s)


@pytest.mark.parametrize("flags, words", [
    (["--max-k", "-1"], "max_k"),
    (["--dtype", "int8"], "dtype"),
    (["--device", "tpu"], "device"),
    (["--http-port", "7000", "--grpc-port", "7000"], "both 7000"),
    (["--kv-budget-bytes", "0"], "kv_budget_bytes"),
    (["--session-ttl-s", "soon"], "session_ttl_s"),
])
def test_bad_settings_stop_the_start_with_a_clear_message(flags: list[str], words: str, tiny_pair: tuple[Path, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_pair[0]), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specsplit-cloud: bad settings:") and words in err


def test_missing_model_directory_is_a_bad_setting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "is not a model directory" in capsys.readouterr().err


def test_prompt_limit_beyond_the_model_context_stops_the_start(tiny_pair: tuple[Path, Path],
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cloud.logs.setup_logging", lambda level: None)  # keep pytest's log handlers
    assert main(["--model", str(tiny_pair[0]), "--max-prompt-len", "100000"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err


def test_settings_validation_error_names_the_field(tiny_pair: tuple[Path, Path]) -> None:
    with pytest.raises(ValidationError, match="max_sessions"):
        CloudSettings(model=tiny_pair[0], max_sessions=0)


def test_every_setting_has_a_description_and_help_prints_it() -> None:
    """One source: a field's description is its --help text, with its default and variable."""
    import re

    from cloud.cli import build_parser

    help_text = re.sub(r"\s+", " ", build_parser().format_help())
    for name, field in CloudSettings.model_fields.items():
        assert field.description, name
        flag = "--api-key" if name == "api_keys" else "--" + name.replace("_", "-")
        assert flag in help_text, name
        assert re.sub(r"\s+", " ", field.description)[:40] in help_text.replace("- ", "-"), name
        assert f"SPECSPLIT_CLOUD_{name.upper()}" in help_text.replace("- ", "-").replace(" ", ""), name


@pytest.mark.parametrize("flags, expected", [
    (["--prefix-cache"], True), (["--prefix-cache", "false"], False), (["--prefix-cache", "true"], True),
    (["--no-prefix-cache"], False), ([], True)])
def test_boolean_flags_take_a_bare_switch_a_value_or_no(flags: list[str], expected: bool,
                                                        tiny_pair: tuple[Path, Path]) -> None:
    s = settings_from_args(["--model", str(tiny_pair[0]), *flags, "--max-k", "5"])
    assert s.prefix_cache is expected and s.max_k == 5
    assert settings_from_args(["--model", str(tiny_pair[0]), "--kv-preallocate"]).kv_preallocate is True
    assert settings_from_args(["--model", str(tiny_pair[0]), "--no-kv-preallocate"]).kv_preallocate is False
    assert settings_from_args(["--model", str(tiny_pair[0]), "--kv-preallocate", "auto"]).kv_preallocate == "auto"
    assert settings_from_args(["--model", str(tiny_pair[0])]).kv_preallocate == "auto"
