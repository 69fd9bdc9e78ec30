"""The common set-up mistakes end in one line that names what is wrong and the fix, without retries
for what cannot succeed and without any download attempt."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from cloud import cli as cloud_cli
from edge.cli import main
from edge.client import EdgeClient
from edge.settings import EdgeSettings
from edge.transport import GrpcTransport, RestTransport
from edge.transport.errors import CloudUnavailable
from shared.errors import InvalidArgument, Unauthenticated


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_draft_path_that_does_not_exist_names_the_flag_and_downloads_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-draft"
    assert main(["generate", "hi", "--draft", str(missing)]) == 2
    err = one_line(capsys)
    assert str(missing) in err and "--draft" in err and "huggingface" not in err.lower()


@pytest.mark.parametrize(("args", "words"), [
    (["--cloud", "127.0.0.1:8000"], ["http://", "127.0.0.1:8000"]),
    (["--grpc", "http://127.0.0.1:50051"], ["HOST:PORT", "127.0.0.1:50051"]),
])
def test_a_url_in_the_wrong_form_is_refused_before_anything_runs(
        args: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--draft", "ngram", *args]) == 2
    err = one_line(capsys)
    assert all(w in err for w in words)


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_an_unreachable_cloud_is_named(transport: str, tiny_pair: tuple[Path, Path],
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPECSPLIT_EDGE_MAX_RETRIES", "0")
    port = free_port()
    where = ["--cloud", f"http://127.0.0.1:{port}"] if transport == "rest" else ["--grpc", f"127.0.0.1:{port}"]
    assert main(["generate", "hi", "--draft", "ngram", "--tokenizer", str(tiny_pair[0]), *where]) == 1
    err = one_line(capsys)
    assert f"127.0.0.1:{port}" in err and "specsplit-cloud running" in err


def test_a_url_without_a_scheme_is_a_configuration_error_never_retried() -> None:
    sleeps: list[float] = []
    client = EdgeClient(EdgeSettings(draft="ngram"), transport=RestTransport("127.0.0.1:8000"), sleep=sleeps.append)
    with pytest.raises(InvalidArgument, match="--cloud"):
        client.model_info()
    assert sleeps == []


def test_a_missing_or_wrong_key_names_the_edges_flag() -> None:
    rest = RestTransport("http://cloud")
    rest._http = httpx.Client(base_url="http://cloud", transport=httpx.MockTransport(lambda r: httpx.Response(
        401, json={"error": {"code": "unauthenticated", "message": "missing API key"}})))
    with pytest.raises(Unauthenticated, match="--api-key KEY or set SPECSPLIT_EDGE_API_KEY"):
        rest.get_model(1.0)


def test_grpc_unreachable_is_unavailable_naming_the_target() -> None:
    port = free_port()
    t = GrpcTransport(f"127.0.0.1:{port}")
    with pytest.raises(CloudUnavailable, match=f"127.0.0.1:{port}.*--grpc"):
        t.get_model(2.0)
    t.close()


def test_the_cloud_without_a_model_names_the_flag_and_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPECSPLIT_CLOUD_MODEL", raising=False)
    assert cloud_cli.main([]) == 2
    err = one_line(capsys)
    assert "--model" in err and "SPECSPLIT_CLOUD_MODEL" in err
