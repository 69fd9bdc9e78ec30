"""The real process with a small KV budget and session cap: eviction -> 404 -> reopen with the
full context -> the same continuation; the session cap; and the operational surface (model info,
reflection, docs, generate, clean SIGTERM)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from transformers import AutoTokenizer

from shared.config import SamplingConfig
from tests.cloud.reference import CausalLM, Drafter, EdgeSim, assert_matches
from tests.cloud.wire import GrpcClient, RestClient, WireError
from tests.server import CloudProcess


def kv_per_token(model_dir: Path) -> int:
    """K and V, every layer, the whole width, float32: one cached position of a GPT-2."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return 2 * cfg["n_layer"] * cfg["n_embd"] * 4


BUDGET_TOKENS = 80
MAX_SESSIONS = 6
TRANSPORTS = ["rest", "grpc"]


@pytest.fixture(scope="module")
def cloud(demo_target_dir: Path) -> Iterator[CloudProcess]:
    # blocks of one position: the budget counts positions exactly as the sessions below are sized; no grace
    # for sessions that have not run a round yet (the fillers below are opened and never used), nor for sessions
    # used just now (the fillers evict ours right after its rounds)
    args = ("--kv-budget-bytes", str(BUDGET_TOKENS * kv_per_token(demo_target_dir)), "--max-sessions", str(MAX_SESSIONS),
            "--kv-block-size", "1", "--eviction-grace-s", "0", "--eviction-active-s", "0")
    c = CloudProcess(demo_target_dir, extra_args=args).start()
    yield c
    c.stop()
    c.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def tok(demo_target_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(demo_target_dir)


@pytest.fixture(scope="module")
def drafter(demo_draft_dir: Path) -> Drafter:
    torch.set_num_threads(1)
    return Drafter(demo_draft_dir)


@pytest.fixture(scope="module")
def target(demo_target_dir: Path) -> CausalLM:
    return CausalLM(demo_target_dir)


def client(transport: str, cloud: CloudProcess) -> RestClient | GrpcClient:
    return RestClient(cloud.http_url) if transport == "rest" else GrpcClient(cloud.grpc_target)


def metric(cloud: CloudProcess, name: str) -> float:
    for line in httpx.get(cloud.http_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_evicted_session_is_404_and_a_reopen_continues_identically(
        transport: str, cloud: CloudProcess, drafter: Drafter, target: CausalLM, tok) -> None:  # type: ignore[no-untyped-def]
    c = client(transport, cloud)
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    prompt = list(tok.encode("def parse(line):\n    fields ="))
    open_body = {"prompt_ids": prompt, "sampling_cfg": cfg.to_dict(), "seed": 31}
    ctx_id = c.open(open_body)["ctx_id"]
    edge = EdgeSim(drafter, prompt, cfg, seed=31)
    sent, answers = [], []
    for _ in range(2):
        body, draft = edge.request(ctx_id, 4)
        answers.append(c.verify(body))
        assert_matches(answers[-1], edge.reference(target, draft, "strict"), len(edge.ids))
        edge.apply(answers[-1], draft)
        sent.append(body)
    evictions = metric(cloud, 'specsplit_cloud_evictions_total{reason="kv_budget"}')
    filler = (prompt * 40)[: BUDGET_TOKENS // 2]
    # two distinct fillers (no shared prefix): room for them, ours goes (LRU)
    others = [c.open({"prompt_ids": [i + 1] + filler[1:]})["ctx_id"] for i in range(2)]
    body, draft = edge.request(ctx_id, 4)
    with pytest.raises(WireError) as e:
        c.verify(body)
    assert e.value.status in (404, "NOT_FOUND")
    assert metric(cloud, 'specsplit_cloud_evictions_total{reason="kv_budget"}') == evictions + 1
    # the edge reopens with its whole context S and goes on
    pending_at_eviction = list(edge.pending)
    reopened = c.open({**open_body, "prompt_ids": list(edge.ids)})
    assert reopened["ctx_len"] == len(edge.ids)
    edge.pending = []
    for _ in range(2):
        body, draft = edge.request(reopened["ctx_id"], 4)
        answers.append(c.verify(body))
        assert_matches(answers[-1], edge.reference(target, draft, "strict"), len(edge.ids))
        edge.apply(answers[-1], draft)
        sent.append(body)
    # a twin that was never evicted, sent the same rounds, answers the same
    for other in others + [reopened["ctx_id"]]:
        close_quietly(c, other)  # the fillers may have been evicted in turn
    twin = c.open(open_body)["ctx_id"]
    for i, (body, answer) in enumerate(zip(sent, answers, strict=True)):
        if i == 2:  # the reopen carried the edge's pending token in its prompt; the twin gets it appended
            body = {**body, "append_ids": pending_at_eviction}
        got = c.verify({**body, "ctx_id": twin})
        assert same_answer(got, answer), i
    c.close(twin)
    c.shutdown()


def same_answer(a: dict, b: dict) -> bool:
    """Equal decisions and contexts; target_dist probs equal to float rounding (a reopened cache is
    prefilled in one pass, the twin's grew round by round). The node budget is the cloud's advice for its load
    at the time, not part of the round's result."""
    skip = ("metrics", "target_dist", "node_budget")
    if {k: v for k, v in a.items() if k not in skip} != {k: v for k, v in b.items() if k not in skip}:
        return False
    if (a["target_dist"] is None) != (b["target_dist"] is None):
        return False
    return a["target_dist"] is None or (a["target_dist"]["ids"] == b["target_dist"]["ids"] and torch.allclose(
        torch.tensor(a["target_dist"]["probs"]), torch.tensor(b["target_dist"]["probs"]), rtol=1e-5, atol=1e-9))


def close_quietly(c: RestClient | GrpcClient, ctx_id: str) -> None:
    try:
        c.close(ctx_id)
    except WireError as e:
        assert e.code == "not_found"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_session_cap_refuses_new_sessions_until_one_closes(transport: str, cloud: CloudProcess, tok) -> None:  # type: ignore[no-untyped-def]
    c = client(transport, cloud)
    small = {"prompt_ids": list(tok.encode("x"))}
    opened = [c.open(small)["ctx_id"] for _ in range(MAX_SESSIONS - int(metric(cloud, "specsplit_cloud_open_sessions")))]
    with pytest.raises(WireError) as e:
        c.open(small)
    assert e.value.status == (429 if transport == "rest" else "RESOURCE_EXHAUSTED")
    assert e.value.body["error"]["limit"] == "max_sessions"
    c.close(opened.pop())
    opened.append(c.open(small)["ctx_id"])
    for ctx_id in opened:
        c.close(ctx_id)
    c.shutdown()


def test_model_info_is_the_same_over_both_transports(cloud: CloudProcess) -> None:
    rest, grpc_ = RestClient(cloud.http_url), GrpcClient(cloud.grpc_target)
    info = rest.model()
    assert info == grpc_.model()
    assert info["model_id"] == "demo-target" and info["vocab_size"] > 0 and info["max_context"] > 0
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    rest.shutdown()
    grpc_.shutdown()


def test_grpc_reflection_lists_the_services(cloud: CloudProcess) -> None:
    with grpc.insecure_channel(cloud.grpc_target) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"specsplit.v1.Verifier", "grpc.health.v1.Health"} <= services


def test_docs_are_served(cloud: CloudProcess) -> None:
    assert httpx.get(cloud.http_url + "/docs").status_code == 200
    assert "/v1/verify" in httpx.get(cloud.http_url + "/openapi.json").json()["paths"]


def test_generate_streams_tokens_as_server_sent_events(cloud: CloudProcess, tok) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt_ids": list(tok.encode("def")), "seed": 2, "max_new_tokens": 8, "stop_at_eos": False}
    plain = httpx.post(cloud.http_url + "/v1/generate", json=body, timeout=30).json()
    events = []
    with httpx.stream("POST", cloud.http_url + "/v1/generate", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["token_id"] for e in events[:-1]] == events[-1]["token_ids"] == plain["token_ids"]
    assert len(plain["token_ids"]) == 8 and plain["metrics"]["tokens"] == 8


def test_sigterm_stops_the_process_cleanly(cloud: CloudProcess) -> None:
    """Last in this module: readiness drops, both servers drain, exit code 0."""
    assert cloud.stop() == 0
    log = cloud.log_text()
    assert '"event": "shutdown"' in log and "Traceback" not in log
