"""Deployment files, checked without a Docker engine: docker-compose.yml as `docker compose config` resolves
it (the prepare service fills the models volume the cloud serves from; memory limits over the measured
peaks; threads and dtype pinned; the tensor-parallel service's missing-model line) and the Dockerfile's
base, user, healthcheck and install steps (the README's: a venv, torch==2.13.0, then the project)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloud.settings import CloudSettings
from modelprep.qwen_coder import DRAFT, TARGET
from tests.ops.deploy import (
    CLOUD_PEAK_BYTES,
    COMPOSE_FILE,
    EDGE_PEAK_BYTES,
    HEADROOM,
    REPO,
    resolved_compose,
    run_compose_config,
    runs_cloud,
)

SETTINGS = set(CloudSettings.model_fields)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The file as YAML reads it (anchors merged, variables not substituted)."""
    return dict(yaml.safe_load(COMPOSE_FILE.read_text()))


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """The file as compose reads it, every profile on."""
    return resolved_compose()


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (REPO / "Dockerfile.cloud").read_text()


def env_names(text: str) -> set[str]:
    return set(re.findall(r"\bSPECSPLIT_CLOUD_([A-Z0-9_]+)\b", text))


def cloud_services(resolved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in resolved["services"].items() if runs_cloud(svc)}


def models_mount(svc: dict[str, Any]) -> dict[str, Any]:
    (mount,) = [v for v in svc.get("volumes", []) if v["type"] == "volume" and v["source"] == "models"]
    return dict(mount)


def option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_compose_config_accepts_the_file_and_rejects_a_broken_copy(tmp_path: Path) -> None:
    """`docker compose config` with every profile on: the file passes, and a misspelt key does not."""
    out = run_compose_config(COMPOSE_FILE, "--quiet")
    assert out.returncode == 0, out.stderr
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("    mem_limit: 12g\n", "    mem_limt: 12g\n", 1))
    out = run_compose_config(broken, "--quiet")
    assert out.returncode != 0 and "mem_limt" in out.stderr


def test_compose_has_the_prepare_service_the_cloud_and_an_edge_demo(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert {"prepare", "cloud", "edge-demo"} <= set(services)
    for svc in services.values():
        if "build" in svc:  # the balancer of the replicas profile is a stock nginx image
            assert svc["build"]["dockerfile"] == "Dockerfile.cloud" and Path(svc["build"]["context"]) == REPO


def test_cloud_ports_match_its_settings(resolved: dict[str, Any]) -> None:
    for name in ("cloud", "cloud-tp"):
        svc = resolved["services"][name]
        env = svc["environment"]
        assert {p["target"] for p in svc["ports"]} == {int(env["SPECSPLIT_CLOUD_HTTP_PORT"]),
                                                      int(env["SPECSPLIT_CLOUD_GRPC_PORT"])}, name
        assert env["SPECSPLIT_CLOUD_HOST"] == "0.0.0.0"  # reachable from the other containers


def test_cloud_healthchecks_ask_readiness_on_their_http_port(resolved: dict[str, Any]) -> None:
    for name, svc in cloud_services(resolved).items():
        hc = svc["healthcheck"]
        assert hc["test"][0] == "CMD", name
        assert f":{svc['environment']['SPECSPLIT_CLOUD_HTTP_PORT']}/readyz" in " ".join(hc["test"]), name
        assert {"interval", "timeout", "retries", "start_period"} <= set(hc), name


def test_every_cloud_env_name_is_a_settings_field(compose: dict[str, Any], dockerfile: str) -> None:
    names = {k.removeprefix("SPECSPLIT_CLOUD_") for svc in compose["services"].values()
             for k in (svc.get("environment") or {}) if k.startswith("SPECSPLIT_CLOUD_")}
    names |= env_names(dockerfile) | env_names(COMPOSE_FILE.read_text())
    assert names, "no SPECSPLIT_CLOUD_* names found"
    unknown = {n for n in names if n.lower() not in SETTINGS}
    assert not unknown, f"not fields of CloudSettings: {sorted(unknown)}"


def test_cloud_env_values_validate_as_settings(resolved: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                               tiny_pair: tuple[Path, Path]) -> None:
    for name, svc in cloud_services(resolved).items():
        with monkeypatch.context() as m:
            for k, v in svc["environment"].items():
                m.setenv(k, str(v))
            m.setenv("SPECSPLIT_CLOUD_MODEL", str(tiny_pair[0]))  # the volume's path does not exist here
            s = CloudSettings()  # type: ignore[call-arg]
            assert s.http_port == 8000 and s.grpc_port == 50051, name


def test_the_prepare_service_fills_the_volume_every_model_user_reads(resolved: dict[str, Any]) -> None:
    """`specsplit-models prepare qwen-coder` writes models/<name> under its working directory: that is the
    volume's mount, and the cloud's model and the edge's draft are the directories it makes there; every
    reader waits for it to finish and mounts the volume read-only."""
    services = resolved["services"]
    prep = services["prepare"]
    assert prep["entrypoint"] == ["specsplit-models"] and prep["command"] == ["prepare", "qwen-coder"]
    assert prep["restart"] == "no" and prep["healthcheck"]["disable"]  # the image's check asks a verifier
    mount = models_mount(prep)
    assert not mount.get("read_only") and Path(prep["working_dir"]) / "models" == Path(mount["target"])
    assert not {"PIP_TARGET", "PYTHONPATH"} & set(prep.get("environment") or {})  # nothing is pip-installed
    assert "models" in resolved["volumes"]
    target = f"{mount['target']}/{TARGET.out.name}"
    readers = {**cloud_services(resolved), "edge-demo": services["edge-demo"]}
    assert {"cloud", "cloud-tp", "replica-1", "edge-demo"} <= set(readers)
    for name, svc in readers.items():
        assert svc["depends_on"]["prepare"]["condition"] == "service_completed_successfully", name
        assert models_mount(svc) == {**mount, "read_only": True}, name
        if name != "edge-demo":
            assert svc["environment"]["SPECSPLIT_CLOUD_MODEL"] == target, name
    assert option(services["edge-demo"]["command"], "--draft") == f"{mount['target']}/{DRAFT.out.name}"


def test_memory_limits_cover_the_measured_peaks(resolved: dict[str, Any]) -> None:
    """Each cloud process's limit is at least HEADROOM x the cloud's measured peak (per rank under torchrun),
    the edge demo's at least HEADROOM x the edge's."""
    for name, svc in cloud_services(resolved).items():
        entry = " ".join(svc.get("entrypoint") or [])
        ranks = int(re.search(r"--nproc-per-node (\d+)", entry).group(1)) if "torchrun" in entry else 1  # type: ignore[union-attr]
        assert int(svc["mem_limit"]) >= ranks * HEADROOM * CLOUD_PEAK_BYTES, name
    assert int(resolved["services"]["edge-demo"]["mem_limit"]) >= HEADROOM * EDGE_PEAK_BYTES


def test_threads_and_dtypes_are_pinned(resolved: dict[str, Any]) -> None:
    """Every torch process has a set number of threads, and every cloud one dtype (not auto, which depends
    on the host's CPU): replicas and ranks compute alike wherever they run."""
    dtypes = set()
    for name, svc in cloud_services(resolved).items():
        env = svc["environment"]
        assert int(env["SPECSPLIT_CLOUD_TORCH_THREADS"]) >= 1, name
        dtypes.add(env["SPECSPLIT_CLOUD_DTYPE"])
    assert dtypes == {"float32"}
    edge = resolved["services"]["edge-demo"]["command"]
    assert int(option(edge, "--threads")) >= 1 and option(edge, "--draft-dtype") != "auto"
    together = int(resolved["services"]["cloud"]["environment"]["SPECSPLIT_CLOUD_TORCH_THREADS"]) \
        + int(option(edge, "--threads"))
    assert together <= 4, "the default services' threads must fit a small host"


def test_edge_demo_waits_for_a_healthy_cloud_and_runs_one_generation(resolved: dict[str, Any]) -> None:
    edge = resolved["services"]["edge-demo"]
    assert edge["depends_on"]["cloud"]["condition"] == "service_healthy" and edge["restart"] == "no"
    cmd = edge["command"]
    assert edge["entrypoint"] == ["specsplit-edge"] and cmd[0] == "generate"
    http_port = resolved["services"]["cloud"]["environment"]["SPECSPLIT_CLOUD_HTTP_PORT"]
    assert option(cmd, "--cloud") == f"http://cloud:{http_port}"
    assert option(cmd, "--mode") == "speculative"


def tp_script(resolved: dict[str, Any]) -> str:
    """cloud-tp's shell entrypoint as the container's shell gets it ($$ is compose's escape of $)."""
    entry = resolved["services"]["cloud-tp"]["entrypoint"]
    assert entry[:2] == ["sh", "-c"]
    return str(entry[2]).replace("$$", "$")


def run_tp_entrypoint(script: str, model: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The entrypoint under sh with a stand-in torchrun that records its arguments."""
    bin_dir, called = tmp_path / "bin", tmp_path / "torchrun-args"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "torchrun"
    fake.write_text(f'#!/bin/sh\necho "$@" > {called}\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SPECSPLIT_CLOUD_MODEL": str(model)}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30), called


def test_tensor_parallel_service_says_one_line_when_its_model_is_missing(resolved: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    """A model directory without config.json: one line naming it and the prepare service, exit 0 and no
    torchrun, so the on-failure policy does not restart it (a rank's failure, non-zero, still does)."""
    tp = resolved["services"]["cloud-tp"]
    assert tp["restart"] == "on-failure"
    out, called = run_tp_entrypoint(tp_script(resolved), tmp_path / "nowhere", tmp_path)
    assert out.returncode == 0 and not called.exists()
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "nowhere") in lines[0], out.stderr
    assert "missing" in lines[0] and "specsplit-models prepare qwen-coder" in lines[0]


def test_compose_tensor_parallel_service_is_rank_0_of_a_torchrun_group(resolved: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out, called = run_tp_entrypoint(tp_script(resolved), model, tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    args = called.read_text().split()
    assert args[-1] == "specsplit-cloud" and "--no-python" in args and "--standalone" in args
    assert int(option(args, "--nproc-per-node")) == 2
    tp = resolved["services"]["cloud-tp"]
    assert tp["profiles"] == ["tp"] and "/readyz" in " ".join(tp["healthcheck"]["test"])
    assert int(tp["shm_size"]) >= 2**30  # torch.distributed between the ranks


def test_dockerfile_is_slim_non_root_with_a_healthcheck(dockerfile: str) -> None:
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim$", dockerfile, re.M)
    users = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/readyz", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["specsplit-cloud"\]$', dockerfile, re.M)
    assert "COPY models/demo-target" in dockerfile
    assert re.search(r"^ +SPECSPLIT_CLOUD_DTYPE=float32", dockerfile, re.M)


def test_the_image_can_prepare_models_into_a_volume_its_user_owns(dockerfile: str, resolved: dict[str, Any]) -> None:
    """The prepare service runs the image as its user: the volume's mount point is that user's (a new named
    volume takes its owner from the image), and the image has the `models` extra that reads GGUF files."""
    mount = models_mount(resolved["services"]["prepare"])["target"]
    assert re.search(rf"install -d -o specsplit -g specsplit {re.escape(mount)}\b", dockerfile)
    assert "['optional-dependencies']['models']" in dockerfile


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
