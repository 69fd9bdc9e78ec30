"""A failover between replicas of other numerics, behind a real nginx: two `specsplit-cloud` replicas of the
bundled demo target, one in float32 and one in bfloat16 (bench.cluster, one torch thread each).

Each replica's `/v1/model` names its numerics (they differ by dtype), and every open answer carries them. A
greedy generation (the model drafter) is paused after PAUSE_AFTER tokens, the replica holding its session is
SIGKILLed, and the generation goes on: nginx moves its routing key to the other replica, which answers 404; the
edge reopens there from its committed text. Nothing is lost (N_NEW tokens, the first PAUSE_AFTER equal to the
first replica's own greedy text, the rest equal to the second replica's greedy continuation of that prefix),
and the edge counts the change of numerics once (`numerics_changes`), where a failover between replicas of
one numerics counts none (tests/e2e/test_replicas.py asserts reopens there; here the count is the point).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.cluster import Cluster, ClusterConfig, Replica
from bench.nginx_conf import nginx_binary
from edge.drafters import ModelDrafter
from edge.transport import RestTransport
from shared.config import SamplingConfig
from tests.e2e.replicas import PausedRuns, edge_client, holder_of, wait_ready

N_NEW = 24
PAUSE_AFTER = 6
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def cluster(demo_target_dir: Path) -> Iterator[Cluster]:
    nginx_binary()  # scripts/test.sh installs it; a clear error otherwise
    cfg = ClusterConfig(replicas=2, model_dir=demo_target_dir, fail_timeout="1s",
                        each_replica_args=(("--dtype", "float32"), ("--dtype", "bfloat16")))
    with Cluster(cfg) as c:
        yield c


def model_info(r: Replica) -> dict[str, Any]:
    return httpx.get(r.http_url + "/v1/model", timeout=10).json()  # type: ignore[no-any-return]


def greedy(r: Replica, prompt_ids: list[int], n: int, cfg: SamplingConfig) -> list[int]:
    """The replica's own greedy continuation under the edge's processing `cfg` (its repetition penalty), target
    only, asked directly, not through nginx."""
    return RestTransport(r.http_url).generate(prompt_ids, cfg, 0, n, 60, stop_at_eos=False).token_ids


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_a_failover_to_other_numerics_keeps_the_text_and_is_counted(cluster: Cluster, demo_target_dir: Path,
                                                                    demo_draft_dir: Path, transport: str) -> None:
    from transformers import AutoTokenizer

    wait_ready(cluster, 2)
    infos = [model_info(r) for r in cluster.replicas]
    assert [i["dtype"] for i in infos] == ["float32", "bfloat16"]
    assert infos[0]["numerics"] != infos[1]["numerics"] and all("weights:" in i["numerics"] for i in infos)

    tokenizer = AutoTokenizer.from_pretrained(demo_target_dir)
    key = f"numerics-{transport}-{uuid.uuid4().hex[:8]}"
    since = cluster.nginx.access_log_size()
    client = edge_client(cluster, transport, tokenizer, ModelDrafter(demo_draft_dir), max_new_tokens=N_NEW,
                         stop_at_eos=False)
    runs = PausedRuns(PAUSE_AFTER, {"greedy": lambda: client.stream(PROMPT, route_key=key)})
    runs.wait_paused()
    holder = holder_of(cluster, key, since)
    other = next(r for r in cluster.replicas if r is not holder)
    cfg = client.settings.sampling()
    holder_text = greedy(holder, tokenizer(PROMPT)["input_ids"], N_NEW, cfg)
    holder.kill()
    try:
        r = runs.finish()["greedy"]
    finally:
        holder.launch()  # back for the other transport's case
    prompt = list(r.prompt_ids)
    assert len(r.token_ids) == N_NEW  # nothing lost
    assert r.metrics.reopens >= 1 and r.metrics.local_commits == 0
    assert r.metrics.numerics_changes == 1
    # the text is the first replica's greedy text up to the reopen point (at or after the pause) and the second
    # replica's greedy continuation of that prefix after it: nothing verified twice, nothing mixed in a round
    for cut in range(PAUSE_AFTER, N_NEW + 1):
        if r.token_ids[:cut] == holder_text[:cut] \
                and r.token_ids[cut:] == greedy(other, prompt + r.token_ids[:cut], N_NEW - cut, cfg):
            break
    else:
        pytest.fail("no reopen point before which the text is the first replica's and after which the second's")
    wait_ready(cluster, 2)
