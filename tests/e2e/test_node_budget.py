"""The node budget (cloud/node_budget.py, PROTOCOL.md "Node budget") against the real cloud process.

- every verify answer carries a budget between 1 and the cloud's largest round, over REST and gRPC alike, and the
  cloud reports the forward cost it fitted (GET /v1/model, gRPC GetModel, /metrics); from the 8th forward on, each
  answer's metrics.row_ms is that fit's row cost as of the answer (0 before);
- the edge sends no more nodes than the last answer's budget, chains and trees alike, and its greedy text stays the
  cloud's own greedy text (a transport that lowers every budget to 2 makes the budget bind on this small pair);
- with the budget off on the edge (an edge that ignores it), rounds keep the edge's own size and are verified as
  before (tests/e2e/test_edge_greedy.py compares such rounds over REST and gRPC with the target's greedy text).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from edge.transport.rest import RestTransport
from shared.hashing import ctx_hash
from shared.protocol import VerifyRequest, VerifyResponse
from tests.cloud.wire import GrpcClient, RestClient
from tests.server import CloudProcess

PROMPT = [17, 402, 9, 88, 1203, 5]


@pytest.fixture(scope="module")
def cloud(tiny_cloud_server: CloudProcess) -> CloudProcess:
    """The session's shared tiny cloud (tests/e2e/conftest.py): this module reads texts, answers and the fitted
    cost, which only grows more certain with the forwards other modules ran."""
    return tiny_cloud_server


def test_answers_carry_a_budget_and_the_cloud_reports_its_fitted_cost(cloud: CloudProcess) -> None:
    for client in (RestClient(cloud.http_url), GrpcClient(cloud.grpc_target)):
        sid = client.open({"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0.0}})["ctx_id"]
        S = list(PROMPT)
        limit = max(client.model()["max_k"], client.model()["max_tree_nodes"])
        for _ in range(12):
            out = client.verify({"ctx_id": sid, "ctx_len": len(S), "ctx_hash": ctx_hash(S), "append_ids": [],
                                 "k": 3, "draft_tokens": [5, 6, 7], "q_token_probs": [0.5] * 3})
            assert 1 <= out["node_budget"] <= limit
            S = S + [5, 6, 7][:out["accepted_len"]] + ([out["correction"]] if out["correction"] is not None else [])
            assert out["ctx_len"] == len(S)
        cost = client.model()["forward_cost"]
        assert cost["forwards"] >= 12 and cost["base_ms"] >= 0 and cost["row_ms"] >= 0
        assert out["metrics"]["row_ms"] == pytest.approx(cost["row_ms"], abs=1e-3)
        assert cost["tokens_per_second"] > 0
    text = httpx.get(f"{cloud.http_url}/metrics").text
    assert "specsplit_cloud_node_budget_count" in text and 'specsplit_cloud_forward_cost_seconds{term="row"}' in text


class LowBudget:
    """A transport that lowers every answer's budget to `budget` and records each request's draft nodes."""

    def __init__(self, inner: Any, budget: int) -> None:
        self.inner, self.budget = inner, budget
        self.sent: list[int] = []
        self.said: list[int] = []
        self.opened = 0

    def open_session(self, req: Any, timeout: float) -> Any:
        info = self.inner.open_session(req, timeout)
        self.opened = info.node_budget  # the first round's (the cloud's own, not lowered)
        return info

    def verify(self, req: VerifyRequest, timeout: float, sampling: Any = None) -> VerifyResponse:
        self.sent.append(len(req.draft.draft_tokens))
        resp = self.inner.verify(req, timeout, sampling)
        self.said.append(min(resp.node_budget, self.budget))
        return replace(resp, node_budget=self.said[-1])

    def routed(self, route_key: str, request_id: str | None = None) -> LowBudget:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("tree", ["auto", "off"])
def test_the_edge_sends_no_more_than_the_budget_and_its_text_stays_the_targets(cloud: CloudProcess, tokenizer: Any,
                                                                             drafter: ModelDrafter,
                                                                             tree: str) -> None:
    s = EdgeSettings(cloud_url=cloud.http_url, temperature=0, max_new_tokens=24, tree=tree, stream_switch=False,
                     fixed_k=6 if tree == "off" else None, timeout_ms=10_000, timeout_fallback=False)
    reference = EdgeClient(s.model_copy(update={"mode": "cloud_only"}), tokenizer=tokenizer)
    for prompt in ["def add(a, b):\n    return a + b\n", "a b c a b c a b c a b c"]:
        low = LowBudget(RestTransport(cloud.http_url), 2)
        spec = EdgeClient(s, transport=low, drafter=drafter, tokenizer=tokenizer).generate(prompt)  # type: ignore[arg-type]
        assert spec.token_ids == reference.generate(prompt).token_ids
        assert 1 <= low.sent[0] <= low.opened  # the first round: the open answer's budget
        assert all(n <= said for n, said in zip(low.sent[1:], low.said, strict=False))
        free = LowBudget(RestTransport(cloud.http_url), 2)
        EdgeClient(s.model_copy(update={"node_budget": False}), transport=free, drafter=drafter,  # type: ignore[arg-type]
                   tokenizer=tokenizer).generate(prompt)
        assert max(free.sent[1:]) > 2  # the budget off: rounds keep the edge's size

