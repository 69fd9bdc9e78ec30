"""The X-Request-Id of a generation: given to `stream(request_id=...)` (or `--request-id`), or a fresh one
per generation, it travels with every cloud call of that generation, REST header and gRPC metadata alike
(a resent open joins its first attempt on the cloud by it)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from edge.cli import build_parser
from edge.transport import GrpcTransport, RestTransport
from shared.errors import InvalidArgument
from shared.protocol import OpenSessionRequest
from shared.request_id import REQUEST_ID_HEADER, check_request_id
from tests.edge.fake_cloud import FakeCloud

PROMPT = [5, 6, 7, 8]


def test_the_client_hands_the_id_to_the_generations_view(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=6)
    client.generate(PROMPT, request_id="cmpl-7")
    client.generate(PROMPT)
    client.generate(PROMPT)
    given, fresh, other = fake_cloud.request_ids
    assert given == "cmpl-7" and fresh and other and fresh != other
    check_request_id(fresh)
    with pytest.raises(InvalidArgument, match="X-Request-Id"):
        client.stream(PROMPT, request_id="two words")


def test_rest_view_sends_the_header_and_the_base_does_not() -> None:
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get(REQUEST_ID_HEADER))
        body: dict[str, Any] = {"ctx_id": "s", "ctx_len": 4, "ctx_hash": "0", "vocab_size": 10}
        return httpx.Response(200, content=json.dumps(body).encode())

    base = RestTransport("http://cloud.test")
    base._http = httpx.Client(base_url="http://cloud.test", transport=httpx.MockTransport(answer))
    base.routed("gen-1", "req-1").open_session(OpenSessionRequest(PROMPT), 1)
    base.routed("gen-2").open_session(OpenSessionRequest(PROMPT), 1)
    base.get_session("s", 1)
    assert seen == ["req-1", None, None]


def test_grpc_view_adds_the_metadata_once() -> None:
    base = GrpcTransport("127.0.0.1:1", api_key="k")
    try:
        view = base.routed("gen-1", "req-1").routed("gen-2", "req-2")
        md = dict(view._metadata)
        assert md[REQUEST_ID_HEADER] == "req-2" and md["x-specsplit-route"] == "gen-2"
        assert len(view._metadata) == 3 and REQUEST_ID_HEADER not in dict(base._metadata)
    finally:
        base.close()


def test_generate_takes_request_id_and_serve_does_not() -> None:
    args = build_parser().parse_args(["generate", "hi", "--draft", "ngram", "--request-id", "r-1"])
    assert args.request_id == "r-1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--draft", "ngram", "--request-id", "r-1"])
