"""deploy/ checked by the tools that read it, offline: promtool (scrape config, alert rules and their
unit tests), the Grafana dashboard's queries against the series the services export, the
Kubernetes manifests (kubernetes-validate, strict schemas), Dockerfile.cloud (hadolint) and
.dockerignore. nginx -t of the balancer config: tests/e2e/test_replicas_deploy.py."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cloud.metrics import CloudMetrics
from edge.prom import EdgePrometheus
from edge.transport.base import ROUTE_HEADER
from tests.ops.tools import DEPLOY, REPO, exported_series, promtool

PROM = DEPLOY / "prometheus"
K8S_VERSION = "1.30.0"
# the dashboard's panels, by what an operator looks for first
DASHBOARD_TOPICS = ("acceptance", "tokens per round", "verify latency", "batch size", "kv", "sessions", "errors",
                    "prefix cache", "queue wait")


def exported() -> set[str]:
    return exported_series(CloudMetrics.create(16, 1).registry) | exported_series(EdgePrometheus.create().registry) \
        | {"up"}


def metric_names(expr: str) -> set[str]:
    """The series an expression selects (label matchers and strings removed first)."""
    bare = re.sub(r'"[^"]*"', "", re.sub(r"\{[^}]*\}", "", expr))
    bare = re.sub(r"\bby\s*\([^)]*\)", "", bare)
    return set(re.findall(r"\b(specsplit_[a-z0-9_]+|process_[a-z0-9_]+|up)\b", bare))


def dashboard() -> dict[str, Any]:
    return dict(json.loads((DEPLOY / "grafana" / "specsplit.json").read_text()))


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def test_scrape_config_passes_promtool_and_scrapes_both_services() -> None:
    out = promtool("check", "config", str(PROM / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = {j["job_name"] for j in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]}
    assert {"specsplit-cloud", "specsplit-edge"} <= jobs


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    out = promtool("check", "rules", str(PROM / "alerts.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    tested = promtool("test", "rules", "alerts_test.yml", cwd=PROM)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    names = {r["alert"] for r in alert_rules()}
    assert {"SpecsplitReplicaDown", "SpecsplitVerifyLatencyHigh", "SpecsplitCloudServerErrors",
            "SpecsplitCloudUnavailable", "SpecsplitAcceptanceCollapse", "SpecsplitKvBudgetNearFull"} <= names


def test_promtool_rule_tests_fail_when_a_threshold_is_off(tmp_path: Path) -> None:
    """The unit tests can fail: with the KV alert's threshold moved past the test's 95%, they do."""
    rules = (PROM / "alerts.yml").read_text()
    assert "specsplit_cloud_kv_budget_bytes{job=\"specsplit-cloud\"} > 0.9" in rules
    (tmp_path / "alerts.yml").write_text(rules.replace('kv_budget_bytes{job="specsplit-cloud"} > 0.9',
                                                       'kv_budget_bytes{job="specsplit-cloud"} > 0.99'))
    (tmp_path / "alerts_test.yml").write_text((PROM / "alerts_test.yml").read_text())
    out = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "SpecsplitKvBudgetNearFull" in out.stdout + out.stderr


def test_every_alert_and_dashboard_query_names_only_exported_series() -> None:
    known = exported()
    queries = [(r["alert"], r["expr"]) for r in alert_rules()] + dashboard_exprs()
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= known, f"{where}: {sorted(names - known)} not exported by the cloud or the edge server"
    assert metric_names('sum by (instance) (rate(specsplit_cloud_nope_total{job="x"}[5m]))') - known, \
        "the check must see a name that is not exported"


def test_dashboard_queries_are_valid_promql_and_cover_the_main_topics(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, (_, expr) in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for topic in DASHBOARD_TOPICS:
        assert topic in titles, f"no dashboard panel about {topic}"
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def k8s_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "cloud.yaml").read_text()) if d]


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_manifests_validate_strictly() -> None:
    docs = k8s_docs()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "Ingress"}
    for d in docs:
        validate(d)
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_deployment_probes_and_ingress_routing() -> None:
    docs = k8s_docs()
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e.get("value") for e in c["env"]}
    grace = float(env["SPECSPLIT_CLOUD_SHUTDOWN_GRACE_S"])
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace  # the drain fits
    ingresses = [d for d in docs if d["kind"] == "Ingress"]
    assert len(ingresses) == 2  # REST and gRPC
    for ing in ingresses:
        assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == \
            "$http_" + ROUTE_HEADER.replace("-", "_")
    svc_ports = {p["name"] for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    assert {"http", "grpc"} <= svc_ports


def test_the_gpu_patch_gives_a_valid_deployment_with_a_gpu() -> None:
    dep = copy.deepcopy(next(d for d in k8s_docs() if d["kind"] == "Deployment"))
    patch = yaml.safe_load((DEPLOY / "k8s" / "gpu-patch.yaml").read_text())
    (pc,) = patch["spec"]["template"]["spec"]["containers"]
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == pc["name"]]
    by_name = {e["name"]: e for e in c["env"]}  # strategic merge: env entries by name, maps merged
    by_name.update({e["name"]: e for e in pc["env"]})
    c["env"] = list(by_name.values())
    c["resources"]["limits"].update(pc["resources"]["limits"])
    validate(dep)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and by_name["SPECSPLIT_CLOUD_DEVICE"]["value"] == "cuda"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "hadolint"
    return subprocess.run([str(exe), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    out = hadolint(REPO / "Dockerfile.cloud")
    assert out.returncode == 0, out.stdout + out.stderr
    sloppy = tmp_path / "Dockerfile"
    sloppy.write_text("FROM python:latest\nRUN apt-get install curl\nCOPY . .\nRUN pip install -e .\n")
    assert hadolint(sloppy).returncode != 0


def test_dockerignore_keeps_the_context_small_and_the_copied_paths_in() -> None:
    ignored = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for must in (".venv", ".git", "tests", "runs"):
        assert must in ignored, f".dockerignore lets {must} into the build context"
    copied = re.findall(r"^COPY (\S+(?: \S+)*) \S+$", (REPO / "Dockerfile.cloud").read_text(), re.M)
    for sources in copied:
        for src in sources.split():
            assert src not in ignored and not any(src.startswith(i.rstrip("/") + "/") for i in ignored
                                                  if not i.startswith("!")), f"{src} is copied but ignored"
            assert (REPO / src).exists(), src


def tp_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "cloud-tp.yaml").read_text()) if d]


def test_the_tensor_parallel_group_validates_and_meets_at_pod_0() -> None:
    """deploy/k8s/cloud-tp.yaml: a StatefulSet of torchrun nodes, a headless Service that publishes
    pods before they are ready (the rendezvous), and a Service that sends traffic to pod 0 (rank 0)."""
    docs = tp_docs()
    for d in docs:
        validate(d)
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    headless = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    served = next(d for d in docs if d["kind"] == "Service" and d is not headless)
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"] and headless["spec"]["publishNotReadyAddresses"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert int(env["NODES"]["value"]) == sts["spec"]["replicas"]
    assert "pod-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    run = " ".join(c["args"])
    master = f"{sts['metadata']['name']}-0.{headless['metadata']['name']}"
    assert "torchrun" in run and f"--master-addr {master}" in run and run.endswith("--no-python specsplit-cloud")
    assert served["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and "livenessProbe" not in c
