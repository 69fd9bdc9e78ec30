"""The OpenAI server under bad input and a missing cloud: sizes, text, tokenization off the event loop,
one shared model-info fetch, ports. In process (TestClient); the cloud here is a port nobody listens on."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from edge.cli import main
from edge.client import EdgeClient
from edge.server.chat import ChatTemplate
from edge.server.openai_api import ServeOptions, create_app
from edge.server.openai_engine import OpenAIEngine
from edge.server.shared_draft import LockedTokenizer, SharedDraftModel
from edge.settings import EdgeSettings
from edge.transport.errors import CloudUnavailable
from shared.tokenizer_id import load_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def engine(tiny_pair: tuple[Path, Path]) -> OpenAIEngine:
    s = EdgeSettings(cloud_url=f"http://127.0.0.1:{free_port()}", draft="ngram", tokenizer=str(tiny_pair[0]),
                     max_retries=0, max_body_bytes=4096)
    return OpenAIEngine(s, SharedDraftModel(s), LockedTokenizer(load_tokenizer(tiny_pair[0])))


@pytest.fixture
def client(engine: OpenAIEngine) -> Iterator[TestClient]:
    app = create_app(engine, ServeOptions(served_model_name="m", chat_template=ChatTemplate(TEMPLATE)))
    with TestClient(app) as c:
        yield c


def test_a_body_over_the_limit_is_413_in_openais_shape(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x" * 5000, "max_tokens": 1})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "payload_too_large" and "4096" in err["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", '{"model": "m", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client: TestClient, path: str, body: str, param: str) -> None:
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and "surrogate" in err["message"]


def test_prompts_are_tokenized_off_the_event_loop(client: TestClient, engine: OpenAIEngine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    on_loop: list[bool] = []
    encode = engine.encode

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(engine, "encode", spy)
    client.post("/v1/completions", json={"model": "m", "prompt": "def f(x):", "max_tokens": 1})
    client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert on_loop == [False, False]


def test_requests_with_the_cloud_down_share_one_model_info_fetch(engine: OpenAIEngine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Six requests at once: one fetch (with its retries), whose error all six get, instead of six fetches
    one after another behind a lock."""
    release, fetches, errors = threading.Event(), [], []

    def unreachable(self: EdgeClient) -> Any:
        fetches.append(1)
        release.wait(10)
        raise CloudUnavailable("cannot reach the cloud")

    monkeypatch.setattr(EdgeClient, "model_info", unreachable)

    def request() -> None:
        try:
            engine.model_info()
        except CloudUnavailable as e:
            errors.append(e)

    threads = [threading.Thread(target=request) for _ in range(6)]
    for t in threads:
        t.start()
    threading.Event().wait(0.5)  # let all six arrive while the first fetch is under way
    release.set()
    for t in threads:
        t.join(10)
    assert len(fetches) == 1 and len(errors) == 6


def test_cloud_down_answers_503_naming_the_cloud(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "m", "prompt": "def f(x):", "max_tokens": 2})
    assert r.status_code == 503 and "specsplit-cloud running" in r.json()["error"]["message"]
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "specsplit-cloud running" in ready.json()["reason"]


def test_serve_on_a_port_in_use_is_refused_in_one_line(tiny_pair: tuple[Path, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--port", str(port), "--draft", "ngram", "--tokenizer", str(tiny_pair[0])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and str(port) in err and "--port" in err


def test_the_request_body_json_is_unchanged_by_the_limit(client: TestClient) -> None:
    """A body under the limit reaches the route whole (it is buffered and replayed)."""
    body = json.dumps({"model": "m", "prompt": "y" * 3000, "max_tokens": 1, "unknown_field": 1})
    r = client.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "unknown_field"


def test_past_max_generations_a_request_is_429_with_retry_after(tiny_pair: tuple[Path, Path]) -> None:
    """--max-generations bounds the draft states (llama.cpp contexts) alive at once: with its one slot held by a
    running generation, the next request answers 429 rate_limit_error / server_busy with Retry-After; once that
    generation ends, a request goes on (here to the absent cloud: 503)."""
    s = EdgeSettings(cloud_url=f"http://127.0.0.1:{free_port()}", draft="ngram", tokenizer=str(tiny_pair[0]),
                     max_retries=0, max_generations=1)
    engine = OpenAIEngine(s, SharedDraftModel(s), LockedTokenizer(load_tokenizer(tiny_pair[0])))
    release, started = threading.Event(), threading.Event()

    def held(*_: Any) -> None:
        started.set()
        release.wait(30)
        raise CloudUnavailable("the test's cloud is gone")

    engine._generate = held  # type: ignore[method-assign]
    app = create_app(engine, ServeOptions(served_model_name="m", chat_template=ChatTemplate(TEMPLATE)))
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    with TestClient(app) as c:
        first: list[int] = []
        t = threading.Thread(target=lambda: first.append(c.post("/v1/completions", json=body).status_code))
        t.start()
        assert started.wait(30)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "server_busy" and "--max-generations" in err["message"]
        release.set()
        t.join(30)
        assert first == [503]
        engine._generate = OpenAIEngine._generate.__get__(engine)  # type: ignore[method-assign]
        assert c.post("/v1/completions", json=body).status_code == 503  # the slot came back: on to the cloud
