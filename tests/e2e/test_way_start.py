"""The session's first speculate-or-stream decision against the real cloud process (tiny target): an open answer
whose forward cost says a verify of k costs about k + 1 steps streams from the first token over the real session
stream (no verify round, no switch) with the cloud alone's greedy text; one that says a verify costs about one step
speculates first; the cloud's own GET /v1/model cost reads as a fit once it has run enough forwards.

The first two tests replace the figures of each open answer (REST) with made-up ones, to force either way. The last
takes the cloud's own figures as they come, over REST and gRPC: from the open answer, and from the model info where
the open answer says none (an older cloud)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.policy.stream import MIN_FORWARDS, ForwardFit
from edge.settings import EdgeSettings
from edge.transport import GrpcTransport, RestTransport
from shared.protocol import OpenSessionRequest, SessionInfo
from tests.server import CloudProcess

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"


@pytest.fixture(scope="module")
def cloud(tiny_cloud_server: CloudProcess) -> CloudProcess:
    """The session's shared tiny cloud (tests/e2e/conftest.py): this module reads texts, answers and the fitted
    cost, which only grows more certain with the forwards other modules ran."""
    return tiny_cloud_server
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


class RecordsOpens:
    """A transport's open answers kept as they came (`opened`); with `drop_cost`, their forward cost taken out, as
    an older cloud's open answer would lack it (nothing is ever added)."""
    opened: list[SessionInfo]
    drop_cost = False

    def open_session(self, req: OpenSessionRequest, timeout: float) -> SessionInfo:
        info: SessionInfo = super().open_session(req, timeout)  # type: ignore[misc]
        self.opened.append(info)
        if self.drop_cost:
            info.forward_cost = None
        return info


class RestRecords(RecordsOpens, RestTransport):
    pass


class GrpcRecords(RecordsOpens, GrpcTransport):
    pass


def recording(cloud: CloudProcess, over: str, drop_cost: bool = False) -> RestRecords | GrpcRecords:
    t = RestRecords(cloud.http_url) if over == "rest" else GrpcRecords(cloud.grpc_target)
    t.opened, t.drop_cost = [], drop_cost
    return t


def settings(cloud: CloudProcess, mode: str = "speculative") -> EdgeSettings:
    return EdgeSettings(cloud_url=cloud.http_url, draft=str(Path(cloud.model_dir)), temperature=0,
                        max_new_tokens=N_NEW, stop_at_eos=False, timeout_ms=10_000, mode=mode)


@pytest.mark.parametrize("over", ["rest", "grpc"])
def test_the_clouds_own_costs_reach_the_first_decision(over: str, tiny_pair: tuple[Path, Path], tokenizer: Any,
                                                      drafter: ModelDrafter) -> None:
    with CloudProcess(tiny_pair[0]) as fresh:
        early = recording(fresh, over)
        first = EdgeClient(settings(fresh), transport=early, drafter=drafter, tokenizer=tokenizer)
        said = first.model_info().forward_cost
        # kept, and readable from the start: the cloud measures its forward's cost before it serves (cloud/core.py)
        assert said is not None and said.forwards >= MIN_FORWARDS and ForwardFit.of(said) is not None
        alone = EdgeClient(settings(fresh, "cloud_only"), transport=recording(fresh, over),
                           tokenizer=tokenizer).generate(PROMPT)  # the cloud's own forwards, one a token
        assert httpx.get(fresh.http_url + "/v1/model", timeout=10).json()["forward_cost"]["forwards"] >= MIN_FORWARDS

        # the first client's decision reads its open answer's figures
        got = first.generate(PROMPT)
        m, cost = got.metrics, early.opened[0].forward_cost
        assert cost is not None and cost.forwards >= MIN_FORWARDS
        assert (m.start_reason, got.token_ids) == ("cloud_costs", alone.token_ids)
        said_k, fit = re.search(r"a verify of (\d+) costs", m.start_note), ForwardFit.of(cost)
        assert said_k is not None and fit is not None
        assert f"costs {fit.steps(int(said_k[1])):.1f} steps" in m.start_note  # the open answer's figures

        # an open answer without the cost (an older cloud): the model info's, fetched now, is read instead
        later = recording(fresh, over, drop_cost=True)
        second = EdgeClient(settings(fresh), transport=later, drafter=drafter, tokenizer=tokenizer)
        info = second.model_info().forward_cost
        assert info is not None and info.forwards >= MIN_FORWARDS and ForwardFit.of(info) is not None
        again = second.generate(PROMPT)
        assert (again.metrics.start_reason, again.token_ids) == ("cloud_costs", alone.token_ids)
