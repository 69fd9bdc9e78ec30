"""Deployment files, checked without a Docker engine: the compose file's services, ports,
healthcheck and settings names; the Dockerfile's base, user, healthcheck and install steps
(the README's: a venv, torch==2.13.0, then the project)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloud.settings import CloudSettings

REPO = Path(__file__).resolve().parents[2]
SETTINGS = set(CloudSettings.model_fields)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "docker-compose.yml").read_text()))


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (REPO / "Dockerfile.cloud").read_text()


def env_names(text: str) -> set[str]:
    return set(re.findall(r"\bSPECSPLIT_CLOUD_([A-Z0-9_]+)\b", text))


def test_compose_has_the_cloud_and_an_edge_demo(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"cloud", "edge-demo"} <= set(services)
    for svc in services.values():
        if "build" in svc:  # the balancer of the replicas profile is a stock nginx image
            assert svc["build"]["dockerfile"] == "Dockerfile.cloud" and (REPO / svc["build"]["context"]).is_dir()


def test_cloud_ports_match_its_settings(compose: dict[str, Any]) -> None:
    cloud = compose["services"]["cloud"]
    env = cloud["environment"]
    published = {int(p.split(":")[-1]) for p in cloud["ports"]}
    assert published == {int(env["SPECSPLIT_CLOUD_HTTP_PORT"]), int(env["SPECSPLIT_CLOUD_GRPC_PORT"])}
    assert env["SPECSPLIT_CLOUD_HOST"] == "0.0.0.0"  # reachable from the other containers


def test_cloud_healthcheck_asks_readiness_on_its_http_port(compose: dict[str, Any]) -> None:
    cloud = compose["services"]["cloud"]
    hc = cloud["healthcheck"]
    assert hc["test"][0] == "CMD" and "/readyz" in " ".join(hc["test"])
    assert f":{cloud['environment']['SPECSPLIT_CLOUD_HTTP_PORT']}/readyz" in " ".join(hc["test"])
    assert {"interval", "timeout", "retries", "start_period"} <= set(hc)


def test_every_cloud_env_name_is_a_settings_field(compose: dict[str, Any], dockerfile: str) -> None:
    names = {k.removeprefix("SPECSPLIT_CLOUD_") for svc in compose["services"].values()
             for k in (svc.get("environment") or {}) if k.startswith("SPECSPLIT_CLOUD_")}
    names |= env_names(dockerfile) | env_names((REPO / "docker-compose.yml").read_text())
    assert names, "no SPECSPLIT_CLOUD_* names found"
    unknown = {n for n in names if n.lower() not in SETTINGS}
    assert not unknown, f"not fields of CloudSettings: {sorted(unknown)}"


def test_cloud_env_values_validate_as_settings(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                               tiny_pair: tuple[Path, Path]) -> None:
    for k, v in compose["services"]["cloud"]["environment"].items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("SPECSPLIT_CLOUD_MODEL", str(tiny_pair[0]))  # the image's path does not exist here
    s = CloudSettings()  # type: ignore[call-arg]
    assert s.http_port == 8000 and s.grpc_port == 50051


def test_edge_demo_waits_for_a_healthy_cloud_and_runs_one_generation(compose: dict[str, Any]) -> None:
    edge = compose["services"]["edge-demo"]
    assert edge["depends_on"]["cloud"]["condition"] == "service_healthy"
    cmd = edge["command"]
    assert edge["entrypoint"] == ["specsplit-edge"] and cmd[0] == "generate"
    http_port = compose["services"]["cloud"]["environment"]["SPECSPLIT_CLOUD_HTTP_PORT"]
    assert cmd[cmd.index("--cloud") + 1] == f"http://cloud:{http_port}"
    assert cmd[cmd.index("--mode") + 1] == "speculative" and "--draft" in cmd


def test_dockerfile_is_slim_non_root_with_a_healthcheck(dockerfile: str) -> None:
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim$", dockerfile, re.M)
    users = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/readyz", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["specsplit-cloud"\]$', dockerfile, re.M)
    assert "COPY models/demo-target" in dockerfile


def test_dockerfile_installs_like_the_readme(dockerfile: str) -> None:
    """Same steps as scripts/setup.sh (the README's install), the same torch pin as pyproject; the
    image installs the dependencies before it copies the source, and the project not editable."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pin = re.search(r'"torch==([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert pin is not None
    torch_pin = f'"torch=={pin.group(1)}"'
    assert re.search(r"pip install -q \S*torch_args\S* " + re.escape(torch_pin), setup)
    assert re.search(r'pip install -q -e "?\.', setup)
    assert "-m venv .venv" in dockerfile and f"pip install -q {torch_pin}" in dockerfile
    deps = dockerfile.index("pip install -q -r /tmp/requirements.txt")
    assert dockerfile.index("-m venv .venv") < dockerfile.index(torch_pin) < deps
    for source in ("COPY shared", "COPY cloud", "COPY edge", "COPY bench"):
        assert deps < dockerfile.index(source), f"{source} comes before the dependencies: every change reinstalls them"
    assert "pip install -q --no-deps ." in dockerfile and " -e ." not in dockerfile
    default_index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)$", dockerfile, re.M)
    assert default_index and default_index.group(1).endswith("/whl/cpu")


def test_setup_passes_extra_pip_arguments_to_the_torch_install_only(tmp_path: Path) -> None:
    """SPECSPLIT_TORCH_PIP_ARGS reaches the torch install (and no other), split into arguments; unset, nothing."""
    import subprocess

    setup = (REPO / "scripts" / "setup.sh").read_text()
    line = next(ln for ln in setup.splitlines() if "torch_args" in ln and "pip install" in ln)
    prelude = next(ln for ln in setup.splitlines() if ln.startswith("read -r -a torch_args"))
    fake = tmp_path / "pip"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT"\n')
    fake.chmod(0o755)
    cmd = line.replace(".venv/bin/python -m pip", str(fake))
    for value, expected in (("--index-url https://example.invalid/whl/cpu", ["install", "-q", "--index-url",
                                                                              "https://example.invalid/whl/cpu"]),
                            ("", ["install", "-q"])):
        out = tmp_path / "args"
        env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "SPECSPLIT_TORCH_PIP_ARGS": value}
        subprocess.run(["bash", "-c", f"set -euo pipefail\n{prelude}\n{cmd}"], env=env, check=True, timeout=30)
        assert out.read_text().split() == [*expected, torch_pin_of_pyproject()]


def torch_pin_of_pyproject() -> str:
    pin = re.search(r'"(torch==[0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert pin is not None
    return pin.group(1)


def test_compose_tensor_parallel_service_is_rank_0_of_a_torchrun_group(compose: dict[str, Any]) -> None:
    tp = compose["services"]["cloud-tp"]
    entry = tp["entrypoint"]
    assert entry[0] == "torchrun" and entry[-1] == "specsplit-cloud" and "--no-python" in entry
    assert int(entry[entry.index("--nproc-per-node") + 1]) == 2
    assert tp["profiles"] == ["tp"] and "/readyz" in " ".join(tp["healthcheck"]["test"])
    env = tp["environment"]
    published = {int(p.split(":")[-1]) for p in tp["ports"]}
    assert published == {int(env["SPECSPLIT_CLOUD_HTTP_PORT"]), int(env["SPECSPLIT_CLOUD_GRPC_PORT"])}
