"""A real Prometheus (Debian's package) scraping a real cloud and a real edge OpenAI server on
loopback, with deploy/prometheus/alerts.yml loaded: after a few generations, every main panel of
deploy/grafana/specsplit.json returns data from Prometheus' HTTP API; both /metrics pass promtool;
one X-Request-Id links the OpenAI answer, the edge's JSON log line and the cloud's log lines."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.cloud_proc import free_port
from tests.e2e.test_openai_server import EXACT, EdgeServeProcess
from tests.ops.tools import DEPLOY, binary, promtool
from tests.server import CloudProcess

SCRAPE_S = 1
# panels that must have data after a few generations (the error panel stays empty on a healthy run)
MAIN_PANELS = ("Acceptance rate", "Tokens per round", "Verify latency p50 / p95",
               "Time to first token / inter-token latency", "Batch size", "KV cache use", "Sessions and queue",
               "Throughput", "Replicas up", "Process memory", "KV blocks and prefix cache",
               "Scheduler queue wait p95 by kind", "Padding avoided")
PROMPTS = ["def fib(n):\n", "The lighthouse keeper had not spoken to another person in eleven days.",
           "import os\nimport sys\n\n\ndef main():\n"]


class PrometheusProcess:
    """`prometheus` as a child on a free loopback port, scraping `targets` ({job: "host:port"}) every second."""

    def __init__(self, targets: dict[str, str], workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        shutil.copy(DEPLOY / "prometheus" / "alerts.yml", workdir / "alerts.yml")
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                  "rule_files": ["alerts.yml"],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                                     for job, t in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusProcess:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary("prometheus"), f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready: {self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def wait_for(self, expr: str, at_least: float, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            res = self.query(expr)
            if res and sum(float(s["value"][1]) for s in res) >= at_least:
                return
            time.sleep(0.5)
        raise AssertionError(f"{expr} did not reach {at_least} within {timeout_s} s: {self.query(expr)}")


@pytest.fixture(scope="module")
def stack(demo_target_dir: Path, demo_draft_dir: Path) -> Iterator[tuple[CloudProcess, EdgeServeProcess]]:
    cloud = CloudProcess(demo_target_dir)
    edge = EdgeServeProcess(["--cloud", cloud.http_url, "--draft", str(demo_draft_dir), "--log-format", "json",
                             # verify rounds throughout: the dashboard's acceptance panels need them, and the tiny
                             # draft (as dear as its target) may stream from the first token otherwise
                             "--k", "4", "--no-stream-switch", *EXACT])
    try:
        edge.spawn()
        with cloud:
            edge.wait_ready()
            yield cloud, edge
    finally:
        edge.stop()


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_prometheus_scrapes_both_services_and_the_dashboard_has_data(
        stack: tuple[CloudProcess, EdgeServeProcess]) -> None:
    cloud, edge = stack
    with tempfile.TemporaryDirectory(prefix="specsplit-prometheus-") as tmp, \
            PrometheusProcess({"specsplit-cloud": f"127.0.0.1:{cloud.http_port}",
                               "specsplit-edge": f"127.0.0.1:{edge.port}"}, Path(tmp)) as prom:
        prom.wait_for('sum(up{job=~"specsplit-cloud|specsplit-edge"})', 2)
        rid = "ops-e2e-1"
        for i, prompt in enumerate(PROMPTS):
            headers = {"X-Request-Id": rid} if i == 0 else {}
            body = {"model": "demo-target", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "stream": i == 2}
            r = httpx.post(edge.url + "/v1/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            if i == 0:
                assert r.headers["x-request-id"] == rid and r.json()["id"] == f"cmpl-{rid}"
            else:
                assert r.headers["x-request-id"]  # made up when not sent
        prom.wait_for('sum(specsplit_edge_generations_total{job="specsplit-edge"})', len(PROMPTS))
        prom.wait_for('sum(specsplit_cloud_rounds_total{job="specsplit-cloud"})', 1)
        # one more generation after Prometheus holds every series: a rate needs an increase between two
        # scrapes, and on a slow machine the first ones may all land before the first scrape of a series
        waits = 'sum(specsplit_cloud_queue_wait_seconds_count{job="specsplit-cloud"})'
        seen = sum(float(s["value"][1]) for s in prom.query(waits))
        r = httpx.post(edge.url + "/v1/completions", timeout=120, json={
            "model": "demo-target", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        prom.wait_for(waits, seen + 1)
        time.sleep(2 * SCRAPE_S)  # one more scrape of every series
        panels = {p["title"]: p for p in json.loads((DEPLOY / "grafana" / "specsplit.json").read_text())["panels"]}
        for title in MAIN_PANELS:
            values = []
            for target in panels[title]["targets"]:
                for s in prom.query(target["expr"].replace("$__rate_interval", "2m")):
                    values.append(float(s["value"][1]))
            assert any(math.isfinite(v) for v in values), f"panel {title!r} has no data: {values}"
        rules = httpx.get(prom.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules

    for url in (cloud.http_url, edge.url):
        out = promtool("check", "metrics", stdin=httpx.get(url + "/metrics", timeout=10).content)
        assert out.returncode == 0, (url, out.stdout + out.stderr)

    # the OpenAI server sends the caller's id with a nonce of the run (ID.<8 hex>) as the cloud's request id
    cloud_lines = [ln for ln in json_lines(cloud.log_path) if str(ln.get("x_request_id", "")).startswith(rid + ".")]
    ctx_ids = {ln["ctx_id"] for ln in cloud_lines if "ctx_id" in ln}
    assert len(ctx_ids) == 1 and any(ln.get("event") == "verify_round" for ln in cloud_lines), cloud_lines[:5]
    edge_lines = [ln for ln in json_lines(Path(edge._log.name)) if ln.get("event") == "generation"]
    mine = [ln for ln in edge_lines if ln.get("x_request_id") == rid]
    assert len(mine) == 1 and mine[0]["finish"] in ("stop", "length") and mine[0]["rounds"] >= 1
    assert 0 < mine[0]["ttft_s"] <= mine[0]["duration_s"]
    assert len(edge_lines) == len(PROMPTS) + 1  # the one after Prometheus held every series
