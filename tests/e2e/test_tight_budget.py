"""Under a KV budget that holds about one session, concurrent generations wait their turn: none fails.

The real cloud (the demo pair's target, float32) gets a budget of 14 blocks of 16 positions; three edges
(threads, two API keys) each generate 24 greedy tokens after a prompt of about 150 tokens, which needs 12
blocks: only one session's cache fits at a time, so the others are answered 429 (resource_exhausted, with
Retry-After) or evicted and reopened until blocks free up. Every generation must end, with the text it has
alone on the same cloud (greedy: the target's own). Before `capacity_wait_s` a generation gave up after
its retries (six, about 3 s of backoff); `test_without_capacity_waits_a_generation_is_refused` shows that a
generation which does not wait (capacity_wait_s = 0, one retry) is refused while another session holds the
blocks: the budget is tight enough that the waits above are needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from shared.errors import ResourceExhausted
from tests.server import CloudProcess

KEYS = ("key-a", "key-b")
BLOCKS, BLOCK = 14, 16
EDGES = 3


def kv_per_token(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return 2 * cfg["n_layer"] * cfg["n_embd"] * 4  # K and V, every layer, float32


@pytest.fixture(scope="module")
def cloud(demo_target_dir: Path) -> Iterator[CloudProcess]:
    # the load as it was sized: the edge's own round sizes and whole prefill slices (with the node budget and the
    # prefill share on, the sessions were spread out and no generation waited for blocks)
    args = ("--kv-budget-bytes", str(BLOCKS * BLOCK * kv_per_token(demo_target_dir)), "--kv-block-size", str(BLOCK),
            "--node-budget", "false", "--prefill-share-with-rounds", "1000",
            # a session opened and not yet verified keeps its blocks this long: the holder of the refusal test
            "--eviction-grace-s", "60")
    with CloudProcess(demo_target_dir, api_keys=KEYS, extra_args=args) as c:
        yield c


def prompt(i: int) -> str:
    return "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(9))


@pytest.fixture(scope="module")
def draft(demo_draft_dir: Path) -> ModelDrafter:
    return ModelDrafter(demo_draft_dir)


def client(cloud: CloudProcess, draft: ModelDrafter, demo_draft_dir: Path, i: int, **kw: Any) -> EdgeClient:
    """Edge i's client (key A or B), its draft forked from one loaded model (loads are not thread-safe); verify
    rounds throughout (a session that streams holds its KV for less time: the budget would not be tight)."""
    s = EdgeSettings(cloud_url=cloud.http_url, api_key=KEYS[i % 2], draft=str(demo_draft_dir),
                     temperature=0, max_new_tokens=24, stop_at_eos=False, seed=i, stream_switch=False, **kw)
    return EdgeClient(s, drafter=draft.fork())


def generate(c: EdgeClient, i: int) -> list[int]:
    try:
        return c.generate(prompt(i)).token_ids
    finally:
        c.close()


@pytest.mark.slow
def test_concurrent_generations_under_a_one_session_budget_all_end_exact(cloud: CloudProcess, draft: ModelDrafter,
                                                                          demo_draft_dir: Path) -> None:
    alone = [generate(client(cloud, draft, demo_draft_dir, i), i) for i in range(EDGES)]
    clients = [client(cloud, draft, demo_draft_dir, i, capacity_wait_s=300) for i in range(EDGES)]
    with ThreadPoolExecutor(EDGES) as pool:
        together = list(pool.map(lambda i: generate(clients[i], i), range(EDGES)))
    assert together == alone


@pytest.mark.slow
def test_without_capacity_waits_a_generation_is_refused(cloud: CloudProcess, draft: ModelDrafter,
                                                        demo_draft_dir: Path) -> None:
    """A session opened on the wire (160 tokens: 10 of the 14 blocks, within its eviction grace) holds the budget;
    a generation with capacity_wait_s = 0 (the old behaviour: retries, then the 429 surfaces) is refused, and after
    the holder closes the same generation gives the text it has alone. Deterministic: the holder cannot be evicted,
    whatever the timing of the threads."""
    headers = cloud.auth_headers(KEYS[0])
    r = httpx.post(cloud.http_url + "/v1/sessions", json={"prompt_ids": [100 + j for j in range(160)]},
                   headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    holder = r.json()["ctx_id"]
    try:
        with pytest.raises(ResourceExhausted):
            generate(client(cloud, draft, demo_draft_dir, 0, capacity_wait_s=0, max_retries=1, backoff_ms=10,
                            backoff_max_ms=10), 0)
    finally:
        assert httpx.delete(f"{cloud.http_url}/v1/sessions/{holder}", headers=headers, timeout=30).status_code == 200
    alone = generate(client(cloud, draft, demo_draft_dir, 0), 0)
    assert alone == generate(client(cloud, draft, demo_draft_dir, 0, capacity_wait_s=0, max_retries=1), 0)
