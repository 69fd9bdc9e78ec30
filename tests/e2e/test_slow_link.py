"""A slow but healthy link (600 ms round trip, added by a TCP proxy) with the edge's defaults, over REST
and gRPC: the generation completes, every token verified, and the greedy text is the target's own
(POST /v1/generate on the direct link). The old default (a fixed 400 ms deadline with the fallback)
committed nearly every token unverified here (specsplit-bench slow-link)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.delay_proxy import DelayProxy
from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from tests.server import CloudProcess

N_NEW = 8
PROMPT = "def area(width, height):\n    return width * height\n\n\ndef volume("
RTT_MS = 600


@pytest.fixture(scope="module")
def slow(cloud: CloudProcess) -> Iterator[dict[str, str]]:
    rest = DelayProxy("127.0.0.1", cloud.http_port, RTT_MS).start()
    grpc = DelayProxy("127.0.0.1", cloud.grpc_port, RTT_MS).start()
    try:
        yield {"rest": rest.url, "grpc": f"127.0.0.1:{grpc.port}"}
    finally:
        rest.stop()
        grpc.stop()


def settings(**kw: Any) -> EdgeSettings:
    return EdgeSettings(temperature=0, repetition_penalty=1.0, max_new_tokens=N_NEW, stop_at_eos=False, **kw)


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_defaults_over_a_600_ms_link_give_the_targets_text_every_token_verified(
        cloud: CloudProcess, slow: dict[str, str], tokenizer: Any, drafter: ModelDrafter, transport: str) -> None:
    target = EdgeClient(settings(cloud_url=cloud.http_url, mode="cloud_only"), tokenizer=tokenizer).generate(PROMPT)
    where = {"cloud_url": slow["rest"]} if transport == "rest" else {"grpc_target": slow["grpc"]}
    r = EdgeClient(settings(**where), drafter=drafter.fork(), tokenizer=tokenizer).generate(PROMPT)
    assert r.token_ids == target.token_ids
    assert r.metrics.local_commits == 0 and r.metrics.by_origin["local"] == 0
