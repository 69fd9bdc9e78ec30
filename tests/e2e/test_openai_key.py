"""`specsplit-edge serve` against a cloud that wants a key it was not given: start-up refuses in one
line, requests answer 502 naming --api-key, /readyz says why (REST and gRPC)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from edge.server.openai_api import ServeOptions, create_app
from edge.server.serve import build_engine, check_cloud
from edge.settings import EdgeSettings
from shared.errors import Unauthenticated
from tests.server import CloudProcess

KEY = "the-key"


@pytest.fixture(scope="module")
def keyed_cloud(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    with CloudProcess(tiny_pair[0], api_keys=(KEY,)) as cloud:
        yield cloud


def settings(cloud: CloudProcess, transport: str, tiny_pair: tuple[Path, Path], **kw: Any) -> EdgeSettings:
    where = {"cloud_url": cloud.http_url} if transport == "rest" else {"grpc_target": cloud.grpc_target}
    return EdgeSettings(**where, draft="ngram", tokenizer=str(tiny_pair[0]), max_retries=0, **kw)


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_serve_without_the_clouds_key_refuses_to_start_naming_the_flag(
        keyed_cloud: CloudProcess, tiny_pair: tuple[Path, Path], transport: str) -> None:
    engine = build_engine(settings(keyed_cloud, transport, tiny_pair))
    with pytest.raises(Unauthenticated, match="--api-key KEY or set SPECSPLIT_EDGE_API_KEY"):
        check_cloud(engine)
    check_cloud(build_engine(settings(keyed_cloud, transport, tiny_pair, api_key=KEY)))  # the right key: ready


def test_requests_without_the_key_answer_502_and_readyz_says_why(keyed_cloud: CloudProcess,
                                                                 tiny_pair: tuple[Path, Path]) -> None:
    engine = build_engine(settings(keyed_cloud, "rest", tiny_pair))
    with TestClient(create_app(engine, ServeOptions(served_model_name="m"))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "def f(x):", "max_tokens": 2})
        assert r.status_code == 502 and "--api-key" in r.json()["error"]["message"]
        ready = c.get("/readyz")
        assert ready.status_code == 503 and "--api-key" in ready.json()["reason"]
    good = build_engine(settings(keyed_cloud, "rest", tiny_pair, api_key=KEY))
    with TestClient(create_app(good, ServeOptions(served_model_name="m"))) as c:
        assert c.get("/readyz").status_code == 200
