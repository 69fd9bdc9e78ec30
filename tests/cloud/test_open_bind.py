"""Safe by default: the cloud refuses to serve beyond loopback without keys unless told so (--allow-open-bind)."""

from __future__ import annotations

import pytest

from cloud.cli import _bind_allowed, main, settings_from_args
from tests.conftest import DEMO_TARGET


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "cloud.example.org"])
def test_a_keyless_cloud_beyond_loopback_is_refused_with_one_line_naming_the_flags(
        host: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSPLIT_CLOUD_API_KEYS", raising=False)
    monkeypatch.delenv("SPECSPLIT_CLOUD_ALLOW_OPEN_BIND", raising=False)
    assert main(["--model", str(DEMO_TARGET), "--host", host]) == 2  # before any model load or port check
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allow-open-bind" in err and "--api-key" in err and host in err


@pytest.mark.parametrize("extra", [["--host", "127.0.0.1"], ["--host", "::1"], ["--host", "localhost"],
                                   ["--host", "0.0.0.0", "--api-key", "k"],
                                   ["--host", "0.0.0.0", "--allow-open-bind"]])
def test_loopback_keys_or_the_explicit_flag_let_it_start(extra: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSPLIT_CLOUD_API_KEYS", raising=False)
    monkeypatch.delenv("SPECSPLIT_CLOUD_ALLOW_OPEN_BIND", raising=False)
    assert _bind_allowed(settings_from_args(["--model", str(DEMO_TARGET), *extra]))
