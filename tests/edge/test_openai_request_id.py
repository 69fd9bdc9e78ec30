"""The OpenAI server's request ids on the cloud: each run of a request sends the caller's X-Request-Id with a
nonce of its own, so two runs under one id never join one cloud session, and the caller's id is still the one
answered with."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from edge.server import openai_engine
from edge.server.chat import ChatTemplate
from edge.server.openai_api import ServeOptions, create_app
from edge.server.openai_engine import OpenAIEngine, cloud_request_id
from edge.server.shared_draft import LockedTokenizer, SharedDraftModel
from edge.settings import EdgeSettings
from shared.request_id import check_request_id
from shared.tokenizer_id import load_tokenizer
from tests.edge.fake_cloud import FakeCloud


def test_two_runs_of_one_seeded_request_under_one_id_open_two_cloud_sessions(
        tiny_pair: tuple[Path, Path], fake_cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch) -> None:
    s = EdgeSettings(draft="ngram", tokenizer=str(tiny_pair[0]), tree="off")
    engine = OpenAIEngine(s, SharedDraftModel(s), LockedTokenizer(load_tokenizer(tiny_pair[0])))
    monkeypatch.setattr(openai_engine, "transport_for", lambda *args: fake_cloud)
    engine._info = fake_cloud.get_model(1.0)
    app = create_app(engine, ServeOptions(served_model_name="m", chat_template=ChatTemplate("")))
    body = {"model": "m", "prompt": "def f(x):", "max_tokens": 6, "temperature": 1.0, "seed": 7}
    with TestClient(app) as c:
        answers = [c.post("/v1/completions", json=body, headers={"X-Request-Id": "cmpl-same"}) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["x-request-id"] for a in answers] == ["cmpl-same", "cmpl-same"]
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]
    sent = [r for r in fake_cloud.request_ids if r]
    assert len(sent) == 2 and sent[0] != sent[1] and all(r.startswith("cmpl-same.") for r in sent)


def test_the_cloud_request_id_keeps_the_callers_id_first_and_fits_the_limit() -> None:
    long = "a" * 128
    ids = {cloud_request_id(long) for _ in range(3)}
    assert len(ids) == 3 and all(check_request_id(i) and len(i) == 128 and i.startswith("a" * 119) for i in ids)
    assert cloud_request_id("x").startswith("x.")
