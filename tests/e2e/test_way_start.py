"""The session's first speculate-or-stream decision against the real cloud process (tiny target, REST): an open
answer whose forward cost says a verify of k costs about k + 1 steps streams from the first token over the real
session stream (no verify round, no switch) with the cloud alone's greedy text; one that says a verify costs about
one step speculates first; the cloud's own GET /v1/model cost reads as a fit once it has run enough forwards.

The cloud does not yet put its forward cost in the open answer: the transport here adds the figures to each open
answer, as a cloud that says them would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from edge.transport import RestTransport
from edge.waycontrol import ForwardFit
from shared.protocol import OpenSessionRequest, SessionInfo
from tests.server import CloudProcess

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
N_NEW = 24
ROW_BOUND = {"base_ms": 1.0, "row_ms": 50.0, "forwards": 200}
FLAT = {"base_ms": 50.0, "row_ms": 0.5, "forwards": 200}


class SaysItsCost(RestTransport):
    """REST whose open answers carry `cost` as their forward cost."""
    cost: dict[str, Any] | None = None

    def open_session(self, req: OpenSessionRequest, timeout: float) -> SessionInfo:
        info = super().open_session(req, timeout)
        object.__setattr__(info, "forward_cost", self.cost)
        return info


def client(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter | None, cost: dict[str, Any] | None,
           mode: str = "speculative") -> EdgeClient:
    s = EdgeSettings(cloud_url=cloud.http_url, draft=str(Path(cloud.model_dir)), temperature=0,
                     max_new_tokens=N_NEW, stop_at_eos=False, timeout_ms=10_000, mode=mode)
    transport = SaysItsCost(cloud.http_url)
    transport.cost = cost
    return EdgeClient(s, transport=transport, drafter=drafter, tokenizer=tokenizer)


def test_a_row_bound_cloud_streams_from_the_first_token(cloud: CloudProcess, tokenizer: Any,
                                                        drafter: ModelDrafter) -> None:
    alone = client(cloud, tokenizer, None, None, mode="cloud_only").generate(PROMPT)
    got = client(cloud, tokenizer, drafter, ROW_BOUND).generate(PROMPT)
    m = got.metrics
    assert got.token_ids == alone.token_ids and len(got.token_ids) == N_NEW
    assert m.verify_calls == 0 and m.switches == 0 and m.streamed == N_NEW and m.stream_calls >= 1
    assert (m.start_way, m.start_reason) == ("stream", "cloud_costs")


def test_a_flat_cloud_speculates_first_and_the_real_fit_reads(cloud: CloudProcess, tokenizer: Any,
                                                             drafter: ModelDrafter) -> None:
    got = client(cloud, tokenizer, drafter, FLAT).generate(PROMPT)
    assert got.rounds and got.rounds[0].decided_by == "cloud" and got.metrics.verify_calls >= 1
    assert (got.metrics.start_way, got.metrics.start_reason) == ("speculate", "cloud_costs")
    cost = httpx.get(cloud.http_url + "/v1/model", timeout=10).json()["forward_cost"]
    assert cost["forwards"] >= 8 and ForwardFit.of(cost) is not None  # the shape the edge reads
