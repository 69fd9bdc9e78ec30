"""Behind a load balancer. The routing key: one per generation (random unless given), the same on every
call of it and across reopens, sent by the REST transport as X-Specsplit-Route; the CLI and settings
take a caller's own. A balancer's own gateway errors (HTML 502 / 503 / 504) are retried with backoff."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from edge.cli import build_parser, settings_from_args
from edge.settings import EdgeSettings
from edge.transport import ROUTE_HEADER, CloudTimeout, RestTransport, error_from_http, is_retryable
from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.protocol import DraftProposal, OpenSessionRequest, VerifyRequest
from tests.edge.fake_cloud import FakeCloud

PROMPT = [5, 6, 7, 8]


def test_each_generation_gets_its_own_key_kept_across_a_reopen(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=12)
    gen = client.stream(PROMPT)
    for n, _tok in enumerate(gen, 1):
        if n == 4:
            fake_cloud.evict_all()  # the next verify answers 404: reopen
    first = gen.result()
    second = client.generate(PROMPT)
    assert first.metrics.reopens == 1
    # one routed view per generation: every call of it, the reopen included, went through that view
    assert fake_cloud.route_keys == [first.route_key, second.route_key]
    assert first.route_key != second.route_key and len(first.route_key) >= 16


def test_a_callers_key_is_used_as_given(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=4, route_key="user-42")
    assert client.generate(PROMPT).route_key == "user-42"  # from the settings
    assert client.generate(PROMPT, route_key="chat.7~a").route_key == "chat.7~a"  # per call
    assert fake_cloud.route_keys == ["user-42", "chat.7~a"]


@pytest.mark.parametrize("bad", ["", "two words", "x" * 129, "naïve", "a\nb"])
def test_a_key_that_cannot_travel_as_a_header_is_refused(make_client, bad: str) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=4)
    with pytest.raises(InvalidArgument):
        client.stream(PROMPT, route_key=bad or " ")
    with pytest.raises(ValidationError):
        EdgeSettings(draft="ngram", route_key=bad)


def test_cli_flag_sets_the_key() -> None:
    args = build_parser().parse_args(["generate", "hi", "--draft", "ngram", "--route-key", "k-1"])
    assert settings_from_args(args).route_key == "k-1"


def test_rest_view_sends_the_key_on_open_verify_get_and_close() -> None:
    seen: list[tuple[str, str, str | None]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers.get(ROUTE_HEADER)))
        if request.url.path == "/v1/verify":
            body: dict[str, Any] = {"accepted_len": 0, "correction": 1, "next_kind": "correction", "ctx_len": 5,
                                    "ctx_hash": "0"}
        else:
            body = {"ctx_id": "s", "ctx_len": 4, "ctx_hash": "0", "vocab_size": 10}
        return httpx.Response(200, content=json.dumps(body).encode())

    base = RestTransport("http://cloud.test")
    base._http = httpx.Client(base_url="http://cloud.test", transport=httpx.MockTransport(answer))
    view = base.routed("gen-1")
    view.open_session(OpenSessionRequest(PROMPT), 1)
    view.verify(VerifyRequest("s", 4, "0", [], DraftProposal([3], [0.5])), 1, SamplingConfig())
    view.get_session("s", 1)
    view.close_session("s", 1)
    base.get_session("s", 1)  # the base transport itself sends no key
    assert [k for _, _, k in seen] == ["gen-1"] * 4 + [None]
    assert base.traffic.calls == 5  # the view counts into the same traffic


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_balancers_gateway_error_is_retried_with_backoff(make_client, fake_cloud: FakeCloud, status: int) -> None:
    page = f"<html><head><title>{status}</title></head><body><center>nginx</center></body></html>".encode()
    err = error_from_http(status, page)
    assert is_retryable(err) and not isinstance(err, CloudTimeout)
    ref, _ = make_client(temperature=0, max_new_tokens=8)
    expected = ref.generate(PROMPT).token_ids
    client, clock = make_client(temperature=0, max_new_tokens=8, backoff_ms=50)
    fake_cloud.fail("verify", err, times=2)
    fake_cloud.fail("open", error_from_http(status, page), times=1)
    r = client.generate(PROMPT)
    assert r.token_ids == expected and r.metrics.retries == 3 and r.metrics.reopens == 0
    assert clock.sleeps == [0.05, 0.05, 0.1]  # open: one backoff; verify: doubling per attempt
