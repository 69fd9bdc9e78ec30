"""deploy/ checked by the tools that read it, offline: promtool (scrape config, alert rules and their
unit tests), the scrape targets against the compose services, the Grafana dashboard's queries against
the series the services export, every Kubernetes manifest (kubernetes-validate, strict schemas; the volumes
and claims they name, the one Job that prepares the models and the pods that wait for it, the model, memory,
threads and dtype of the verifier pods), every Dockerfile
(hadolint), .dockerignore (what reaches the build context) and yamllint. nginx -t of the balancer config:
tests/e2e/test_replicas_deploy.py."""

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
from modelprep.qwen_coder import TARGET
from tests.ops.deploy import (
    CLOUD_PEAK_BYTES,
    EDGE_PEAK_BYTES,
    HEADROOM,
    PREPARE_PEAK_BYTES,
    PREPARED_BYTES,
    build_context,
    dockerignore_rules,
    dockerignored,
    quantity,
    resolved_compose,
)
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


def scrape_targets(config: dict[str, Any]) -> dict[str, list[str]]:
    """{job: [host:port, ...]} of the static targets of a scrape config."""
    return {j["job_name"]: [t for sc in j.get("static_configs", []) for t in sc["targets"]]
            for j in config["scrape_configs"]}


def targets_not_served(config: dict[str, Any], compose: dict[str, Any]) -> list[str]:
    """The static targets that are not a compose service on its REST port."""
    ports = {name: svc["environment"].get("SPECSPLIT_CLOUD_HTTP_PORT") for name, svc in compose["services"].items()
             if "environment" in svc}
    return [t for targets in scrape_targets(config).values() for t in targets
            if ports.get(t.rsplit(":", 1)[0]) != t.rsplit(":", 1)[1]]


def test_scrape_config_passes_promtool_and_scrapes_only_compose_services() -> None:
    out = promtool("check", "config", str(PROM / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    compose = resolved_compose()
    jobs = scrape_targets(config)
    assert jobs["specsplit-cloud"] == ["cloud:8000"]  # what `docker compose up` runs
    assert not targets_not_served(config, compose)
    # an edge job only where compose runs an edge server (specsplit-edge serve)
    edge_servers = [n for n, s in compose["services"].items() if (s.get("command") or [None])[0] == "serve"]
    assert ("specsplit-edge" in jobs) == bool(edge_servers)
    stale = {"scrape_configs": [*config["scrape_configs"],
                                {"job_name": "specsplit-edge", "static_configs": [{"targets": ["edge:8001"]}]}]}
    assert targets_not_served(stale, compose) == ["edge:8001"]


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


def k8s_files() -> list[Path]:
    """The manifests applied as they are (gpu-patch.yaml is a patch, checked merged)."""
    return sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "gpu-patch.yaml")


def k8s_docs(path: Path = DEPLOY / "k8s" / "cloud.yaml") -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_kubernetes_manifest_validates_strictly() -> None:
    files = k8s_files()
    assert {p.name for p in files} >= {"cloud.yaml", "cloud-tp.yaml"}
    for path in files:
        for d in k8s_docs(path):
            validate(d)
    assert {d["kind"] for d in k8s_docs()} >= {"Deployment", "Service", "Ingress"}
    broken = copy.deepcopy(next(d for d in k8s_docs() if d["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def all_k8s_docs() -> list[dict[str, Any]]:
    return [d for p in k8s_files() for d in k8s_docs(p)]


def workloads() -> list[dict[str, Any]]:
    return [d for d in all_k8s_docs() if d["kind"] in ("Deployment", "StatefulSet")]


def undefined_volumes(workload: dict[str, Any], docs: list[dict[str, Any]]) -> list[str]:
    """The volumes a workload's containers mount that its pod does not define, and the claims it names that
    no PersistentVolumeClaim in `docs` defines."""
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    missing = [f"volume {m['name']}" for c in pod["containers"] + pod.get("initContainers", [])
               for m in c.get("volumeMounts", []) if m["name"] not in volumes and m["name"] not in templates]
    return missing + [f"claim {v['persistentVolumeClaim']['claimName']}" for v in volumes.values()
                      if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in claims]


def test_every_volume_and_claim_a_pod_uses_is_defined() -> None:
    docs = all_k8s_docs()
    for w in [*workloads(), *(d for d in docs if d["kind"] == "Job")]:
        assert not undefined_volumes(w, docs), (w["metadata"]["name"], undefined_volumes(w, docs))
    # the tensor-parallel group reading a claim that nothing defines
    tp = copy.deepcopy(next(w for w in workloads() if w["kind"] == "StatefulSet"))
    (models,) = [v for v in tp["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
    models["persistentVolumeClaim"]["claimName"] = "specsplit-tp-models"
    assert undefined_volumes(tp, docs) == ["claim specsplit-tp-models"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def command_line(container: dict[str, Any]) -> str:
    return " ".join([*container.get("command", []), *container.get("args", [])])


def pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    pod = doc["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def claim_mount(doc: dict[str, Any], container: dict[str, Any]) -> tuple[str, dict[str, Any], bool]:
    """(claim name, the container's mount of it, whether the pod's volume is read-only) of the one claim the
    container mounts."""
    volumes = {v["name"]: v["persistentVolumeClaim"] for v in doc["spec"]["template"]["spec"].get("volumes", [])
               if "persistentVolumeClaim" in v}
    (mount,) = [m for m in container.get("volumeMounts", []) if m["name"] in volumes]
    claim = volumes[mount["name"]]
    return claim["claimName"], mount, claim.get("readOnly", False)


def prepare_job() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Job, its container) that runs `specsplit-models prepare`: exactly one in deploy/k8s/."""
    jobs = [(d, c) for d in all_k8s_docs() if d["kind"] == "Job" for c in pod_containers(d)
            if "specsplit-models prepare" in command_line(c)]
    assert len(jobs) == 1, [d["metadata"]["name"] for d, _ in jobs]
    return jobs[0]


def marker_in_claim(doc: dict[str, Any], container: dict[str, Any]) -> tuple[str, Path]:
    """(claim, path inside it) of the file MODELS_READY names: the Job's done-marker, or what a pod waits for."""
    claim, mount, _ = claim_mount(doc, container)
    return claim, Path(env_of(container)["MODELS_READY"]).relative_to(mount["mountPath"])


def test_one_job_prepares_the_models_and_no_verifier_pod_prepares_its_own() -> None:
    """One Job (restarted on failure, a bounded number of times) runs `prepare qwen-coder` into its claim with
    the verifiers' image; no pod template of a verifier runs specsplit-models, in an init container or else."""
    job, prep = prepare_job()
    assert "specsplit-models prepare qwen-coder" in command_line(prep)
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure" and 0 < job["spec"]["backoffLimit"] <= 6
    _, mount, read_only = claim_mount(job, prep)
    # specsplit-models writes under ./models
    assert Path(prep["workingDir"]) / "models" == Path(mount["mountPath"])
    assert not read_only and not mount.get("readOnly")
    assert not {"PIP_TARGET", "PYTHONPATH"} & set(env_of(prep))  # no part wheels are installed any more
    for w in workloads():
        assert not [c["name"] for c in pod_containers(w) if "specsplit-models prepare" in command_line(c)], \
            w["metadata"]["name"]
        assert prep["image"] == next(c for c in pod_containers(w) if c["name"] == "cloud")["image"]


def test_the_prepare_job_and_its_claim_are_sized_above_their_measured_figures() -> None:
    """The Job's memory limit is HEADROOM x prepare's measured 13.5 GB peak at least and its request the peak; the
    claim (ReadWriteMany: replicas on other nodes read it) holds HEADROOM x the prepared files' 11.3 GB."""
    job, prep = prepare_job()
    res = prep["resources"]
    assert quantity(res["limits"]["memory"]) >= HEADROOM * PREPARE_PEAK_BYTES
    assert quantity(res["requests"]["memory"]) >= PREPARE_PEAK_BYTES
    name, _, _ = claim_mount(job, prep)
    (claim,) = [d for d in all_k8s_docs() if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == name]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert quantity(claim["spec"]["resources"]["requests"]["storage"]) >= HEADROOM * PREPARED_BYTES


def test_every_verifier_pod_mounts_the_jobs_claim_read_only_and_waits_for_its_marker() -> None:
    """Each verifier pod reads the Job's claim read-only, its one init container waits for the file the Job
    writes last (the same path inside the claim), and the cloud's model is the target the Job prepared there."""
    job, prep = prepare_job()
    job_claim, job_mount, _ = claim_mount(job, prep)
    target_in_claim = (Path(prep["workingDir"]) / TARGET.out).relative_to(job_mount["mountPath"])
    for w in workloads():
        pod = w["spec"]["template"]["spec"]
        (wait,) = pod["initContainers"]
        (cloud,) = [c for c in pod["containers"] if c["name"] == "cloud"]
        assert marker_in_claim(w, wait) == marker_in_claim(job, prep), w["metadata"]["name"]
        for c in (wait, cloud):
            claim, mount, read_only = claim_mount(w, c)
            assert claim == job_claim and read_only and mount["readOnly"], (w["metadata"]["name"], c["name"])
        _, read, _ = claim_mount(w, cloud)
        assert Path(env_of(cloud)["SPECSPLIT_CLOUD_MODEL"]).relative_to(read["mountPath"]) == target_in_claim


def test_the_marker_comes_after_prepare_succeeds_and_ends_the_wait(tmp_path: Path) -> None:
    """The Job's and the wait container's commands run here as the kubelet runs them (sh, the container's env;
    a stub specsplit-models on PATH): no marker when prepare fails (and the failure is the container's exit
    status, so the Job retries), the marker when it succeeds, and none again once a later run fails (the
    marker is removed before prepare starts: a re-prepare never leaves an earlier run's marker standing); the
    wait logs while the marker is missing and ends, status 0, once it is there."""
    import os
    import signal
    import stat

    _, prep = prepare_job()
    bin_dir, marker = tmp_path / "bin", tmp_path / "claim" / "qwen-coder.prepared"
    bin_dir.mkdir()
    marker.parent.mkdir()
    stub = bin_dir / "specsplit-models"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MODELS_READY": str(marker)}

    def prepare(status: int) -> int:
        stub.write_text(f"#!/bin/sh\nexit {status}\n")
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
        return subprocess.run([*prep["command"], *prep["args"]], env=env, timeout=30).returncode

    assert prepare(2) == 2 and not marker.exists()
    assert prepare(0) == 0 and marker.is_file()
    assert prepare(2) == 2 and not marker.exists()
    assert prepare(0) == 0 and marker.is_file()

    (wait,) = workloads()[0]["spec"]["template"]["spec"]["initContainers"]
    marker.unlink()
    waiting = subprocess.Popen([*wait["command"], *wait["args"]], env=env, stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=2)
    finally:
        os.killpg(waiting.pid, signal.SIGKILL)  # its sleep too, which holds the pipe
    assert f"waiting for {marker}" in waiting.communicate()[0]
    marker.touch()
    done = subprocess.run([*wait["command"], *wait["args"]], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and f"found {marker}" in done.stdout
    assert [c for w in workloads() for c in w["spec"]["template"]["spec"]["initContainers"]
            if [*c["command"], *c["args"]] != [*wait["command"], *wait["args"]]] == []


def test_verifier_pods_serve_within_their_memory() -> None:
    """Each verifier pod's limit is HEADROOM x the cloud's measured peak at least, threads = the CPU request per
    rank, the dtype pinned to float32, the runner to PyTorch."""
    assert {w["metadata"]["name"] for w in workloads()} == {"specsplit-cloud", "specsplit-cloud-tp"}
    for w in workloads():
        (cloud,) = [c for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "cloud"]
        env = env_of(cloud)
        res = cloud["resources"]
        assert quantity(res["limits"]["memory"]) >= HEADROOM * CLOUD_PEAK_BYTES, w["metadata"]["name"]
        assert quantity(res["requests"]["memory"]) >= CLOUD_PEAK_BYTES
        per_node = int(env.get("NPROC_PER_NODE", "1"))
        assert int(env["SPECSPLIT_CLOUD_TORCH_THREADS"]) * per_node == quantity(res["requests"]["cpu"])
        assert env["SPECSPLIT_CLOUD_DTYPE"] == "float32"
        assert env["SPECSPLIT_CLOUD_RUNNER"] == "torch"  # pinned: the peak above is the PyTorch runner's


def test_every_compose_verifier_pins_its_runner() -> None:
    """Replicas never differ by whether llama.cpp happened to build: every compose service that runs the cloud
    pins SPECSPLIT_CLOUD_RUNNER (the image is PyTorch's; its limits are the PyTorch runner's measured peak)."""
    import yaml

    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    clouds = {n: svc for n, svc in compose["services"].items() if "SPECSPLIT_CLOUD_MODEL" in
              (svc.get("environment") or {})}
    assert clouds
    for name, svc in clouds.items():
        assert svc["environment"].get("SPECSPLIT_CLOUD_RUNNER") == "torch", name


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
    cpu_image, c["image"] = c["image"], pc.get("image", c["image"])
    validate(dep)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and by_name["SPECSPLIT_CLOUD_DEVICE"]["value"] == "cuda"
    assert c["image"] != cpu_image  # the CPU image's torch cannot use the GPU


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "hadolint"
    return subprocess.run([str(exe), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def dockerfiles() -> list[Path]:
    return sorted(REPO.glob("Dockerfile*")) + sorted(REPO.glob("deploy/**/Dockerfile*"))


def test_every_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    assert REPO / "Dockerfile.cloud" in dockerfiles()
    for path in dockerfiles():
        out = hadolint(path)
        assert out.returncode == 0, f"{path.name}: {out.stdout}{out.stderr}"
    sloppy = tmp_path / "Dockerfile"
    sloppy.write_text("FROM python:latest\nRUN apt-get install curl\nCOPY . .\nRUN pip install -e .\n")
    assert hadolint(sloppy).returncode != 0


def copied_sources() -> list[str]:
    """Every local source of a COPY in every Dockerfile (not --from another stage)."""
    sources = []
    for path in dockerfiles():
        for line in re.findall(r"^COPY (?!--from)(.+)$", path.read_text(), re.M):
            sources += [s for s in line.split()[:-1] if not s.startswith("--")]
    return sources


def test_dockerignore_lets_in_what_is_copied_and_nothing_big() -> None:
    text = (REPO / ".dockerignore").read_text()
    rules = dockerignore_rules(text)
    exceptions = [ln.strip()[1:] for ln in text.splitlines() if ln.strip().startswith("!")]
    context = build_context(REPO, rules, exceptions)
    for src in copied_sources():
        assert (REPO / src).exists(), src
        assert not dockerignored(src, rules), f"{src} is copied but left out of the context"
        if (REPO / src).is_dir():
            assert any(f.startswith(src.rstrip("/") + "/") for f in context), f"nothing of {src} reaches the context"
    assert sum(context.values()) < 100 * 10**6, f"the build context is {sum(context.values()) / 1e6:.0f} MB"
    assert not [f for f in context if "__pycache__" in f or f.startswith((".git/", ".venv/", "tests/"))]


def test_dockerignore_leaves_out_the_prepared_models(tmp_path: Path) -> None:
    """A checkout where the coder pair and SmolLM2 are prepared (files of a byte): none of them is sent."""
    text = (REPO / ".dockerignore").read_text()
    rules = dockerignore_rules(text)
    exceptions = [ln.strip()[1:] for ln in text.splitlines() if ln.strip().startswith("!")]
    prepared = ["models/gguf/qwen2.5-coder-1.5b-instruct.gguf", "models/qwen2.5-coder-1.5b-instruct/model.safetensors",
                "models/qwen2.5-coder-0.5b-instruct/model.safetensors", "models/smollm2-135m-instruct/model.safetensors",
                "models/qwen2.5-coder-1.5b-instruct.partial/model.safetensors", ".venv/lib/torch.so",
                "cloud/__pycache__/app.cpython-311.pyc", ".mypy_cache/x.json"]
    kept = ["models/demo-target/config.json", "cloud/app.py", "pyproject.toml"]
    for rel in prepared + kept:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert sorted(build_context(tmp_path, rules, exceptions)) == sorted(kept)
    assert dockerignored("models/qwen2.5-coder-1.5b-instruct/model.safetensors", rules)
    assert not dockerignored("models/qwen2.5-coder-1.5b-instruct/model.safetensors", dockerignore_rules("models/gguf"))


def test_deploy_yaml_passes_yamllint() -> None:
    exe = Path(sys.executable).parent / "yamllint"
    config = DEPLOY / "yamllint.yml"
    out = subprocess.run([str(exe), "-s", "-c", str(config), "docker-compose.yml", "deploy/"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    bad = subprocess.run([str(exe), "-s", "-c", str(config), "-"], input="a: 1\na: 2\n", capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0  # a duplicate key


def tp_docs() -> list[dict[str, Any]]:
    return k8s_docs(DEPLOY / "k8s" / "cloud-tp.yaml")


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
    assert "exec" in c["readinessProbe"] and "livenessProbe" not in c


def test_every_tensor_parallel_rank_is_probed_on_what_it_serves(tmp_path: Path) -> None:
    """A StatefulSet's rolling update waits for each pod to be Ready, and only rank 0 serves HTTP: the probe
    (run here as the kubelet runs it, with the pod's environment) passes on a rank > 0 with nothing listening, and
    on rank 0 only while /readyz answers 200."""
    import http.server
    import os
    import socket
    import threading

    (c,) = next(d for d in tp_docs() if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"]
    command = c["readinessProbe"]["exec"]["command"]
    assert command[0] == "python"  # the image's (its venv first on PATH); this test's interpreter here
    probe = [sys.executable, *command[1:]]
    status = [503]

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status[0] if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            return None

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]

    def ready(rank: str, port: int) -> bool:
        env = {**os.environ, "NODE_RANK": rank, "SPECSPLIT_CLOUD_HTTP_PORT": str(port)}
        return subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 0

    assert ready("1", free) and not ready("0", free)  # nothing listens: rank 1 ready, rank 0 not
    server = http.server.HTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert not ready("0", port)  # 503: loading, or a lost rank
        status[0] = 200
        assert ready("0", port)
    finally:
        server.shutdown()


def compose_file() -> dict[str, Any]:
    """docker-compose.yml as YAML reads it (anchors merged), without docker."""
    return dict(yaml.safe_load((REPO / "docker-compose.yml").read_text()))


def test_compose_publishes_every_port_on_loopback_and_says_so_to_a_keyless_cloud() -> None:
    """Safe by default: nothing is published beyond the host's loopback, and a verifier binding the container's
    0.0.0.0 without keys says that it means to (SPECSPLIT_CLOUD_ALLOW_OPEN_BIND), or it would refuse to start."""
    from shared.hosts import is_loopback

    services = compose_file()["services"]
    published = [(name, p) for name, svc in services.items() for p in svc.get("ports", [])]
    assert published
    for name, port in published:
        host = str(port).rsplit(":", 2)[0] if str(port).count(":") == 2 else ""
        assert is_loopback(host), f"{name} publishes {port} beyond loopback"
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if "SPECSPLIT_CLOUD_HOST" in env and not is_loopback(env["SPECSPLIT_CLOUD_HOST"]):
            assert env.get("SPECSPLIT_CLOUD_API_KEYS") or env.get("SPECSPLIT_CLOUD_ALLOW_OPEN_BIND") == "true", name


def test_compose_limits_cover_what_each_service_runs_and_no_part_wheel_variables_are_left() -> None:
    """Each compose limit against the measured figure it names (tests/ops/deploy.py): the float32 PyTorch cloud's
    15.1 GB per process, prepare's 13.5 GB; and no PIP_TARGET / PYTHONPATH for part wheels nothing installs."""
    from tests.ops.deploy import EDGE_PEAK_BYTES

    services = compose_file()["services"]
    for name, svc in services.items():
        env = svc.get("environment") or {}
        assert not {"PIP_TARGET", "PYTHONPATH"} & set(env), name
        if env.get("SPECSPLIT_CLOUD_MODEL"):
            ranks = 2 if "torchrun" in " ".join(svc.get("entrypoint") or []) else 1
            assert env["SPECSPLIT_CLOUD_DTYPE"] == "float32", name
            assert quantity(svc["mem_limit"].replace("g", "Gi")) >= ranks * HEADROOM * CLOUD_PEAK_BYTES, name
    assert quantity(services["prepare"]["mem_limit"].replace("g", "Gi")) >= HEADROOM * PREPARE_PEAK_BYTES
    assert quantity(services["edge-demo"]["mem_limit"].replace("g", "Gi")) >= HEADROOM * EDGE_PEAK_BYTES
    assert "PIP_TARGET" not in (REPO / "Dockerfile.cloud").read_text()


def test_every_kubernetes_verifier_takes_its_keys_from_a_required_secret() -> None:
    """The pods bind 0.0.0.0 behind an Ingress: the key Secret is required (no `optional: true`), so a cluster
    without it runs no keyless verifier."""
    for w in workloads():
        (cloud,) = [c for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "cloud"]
        env = {e["name"]: e for e in cloud["env"]}
        assert env["SPECSPLIT_CLOUD_HOST"]["value"] == "0.0.0.0"
        ref = env["SPECSPLIT_CLOUD_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "specsplit-api-keys" and not ref.get("optional", False), w["metadata"]["name"]


def test_the_measured_figures_the_limits_are_sized_on_are_the_readmes() -> None:
    """The README's requirements table is the place of record of the measured memory and disk: the figures the
    limits above are checked against are the ones it states (to its one decimal in GB)."""
    table = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| memory |"))
    disk = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| disk |"))
    assert f"`specsplit-models prepare qwen-coder` {PREPARE_PEAK_BYTES / 1e9:.1f} GB" in table
    assert f"{CLOUD_PEAK_BYTES / 1e9:.1f} GB in float32" in table
    assert f"the 0.5B draft in bfloat16 {EDGE_PEAK_BYTES / 1e9:.1f} GB" in table
    assert f"the coder pair {PREPARED_BYTES / 1e9:.1f} GB" in disk
