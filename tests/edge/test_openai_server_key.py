"""The OpenAI server's own keys (--server-api-key): OpenAI's Bearer check on every /v1 route through the
official `openai` client, /healthz and /readyz open, and no start beyond loopback without a key. In process
(TestClient); the cloud here is a port nobody listens on."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from edge.cli import main
from edge.server.openai_api import ServeOptions, create_app
from edge.server.openai_engine import OpenAIEngine
from edge.server.server_auth import check_exposure, is_loopback
from edge.server.shared_draft import LockedTokenizer, SharedDraftModel
from edge.settings import EdgeSettings
from shared.tokenizer_id import load_tokenizer

KEYS = ["first-key", "second-key"]


@pytest.fixture
def client(tiny_pair: tuple[Path, Path]) -> Iterator[TestClient]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = EdgeSettings(cloud_url=f"http://127.0.0.1:{port}", draft="ngram", tokenizer=str(tiny_pair[0]),
                            max_retries=0, server_api_keys=KEYS)  # type: ignore[arg-type]
    engine = OpenAIEngine(settings, SharedDraftModel(settings), LockedTokenizer(load_tokenizer(tiny_pair[0])))
    with TestClient(create_app(engine, ServeOptions(served_model_name="m"))) as c:
        yield c


def openai_client(http: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def test_either_key_is_let_in_and_a_wrong_one_is_a_401_in_openais_shape(client: TestClient) -> None:
    for key in KEYS:
        assert [m.id for m in openai_client(client, key).models.list()] == ["m"]
    with pytest.raises(openai.AuthenticationError) as e:
        openai_client(client, "not-a-key").completions.create(model="m", prompt="hi", max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body == {"message": e.value.body["message"], "type": "invalid_request_error",  # type: ignore
                            "param": None, "code": "invalid_api_key"}


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/m", "/v1/completions", "/v1/chat/completions"])
def test_every_v1_route_without_a_key_is_401(client: TestClient, path: str) -> None:
    r = client.post(path, json={}) if "completions" in path else client.get(path)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "--server-api-key" in r.json()["error"]["message"]
    wrong_scheme = client.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"})
    assert wrong_scheme.status_code == 401


def test_health_and_readiness_stay_open(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 503  # no key needed: the cloud is down, and it says so


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2", "[::1]"])
def test_loopback_needs_no_key(host: str) -> None:
    assert is_loopback(host)
    check_exposure(host, [])


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "edge.example.org"])
def test_beyond_loopback_needs_a_key(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="--server-api-key"):
        check_exposure(host, [])
    check_exposure(host, ["k"])


def test_serve_on_all_interfaces_without_a_key_refuses_in_one_line(tiny_pair: tuple[Path, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--host", "0.0.0.0", "--port", "1", "--draft", "ngram", "--tokenizer", str(tiny_pair[0])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--server-api-key" in err and "0.0.0.0" in err
