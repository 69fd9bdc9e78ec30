"""The replica deployment files, without Docker: deploy/nginx.conf is bench.cluster's rendering for the
compose services, the compose `replicas` profile matches it, and nginx itself accepts the directives."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.nginx_conf import COMPOSE_PORTS, COMPOSE_REPLICAS, compose_nginx_conf, nginx_binary, nginx_conf
from edge.transport import ROUTE_HEADER

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "docker-compose.yml").read_text()))


def test_deploy_nginx_conf_is_the_rendering_for_compose() -> None:
    assert (REPO / "deploy" / "nginx.conf").read_text() == compose_nginx_conf(), \
        "deploy/nginx.conf is stale: rewrite it from bench.nginx_conf.compose_nginx_conf()"


def test_both_upstreams_hash_the_header_the_edge_sends() -> None:
    conf = compose_nginx_conf()
    variable = "$http_" + ROUTE_HEADER.replace("-", "_")
    assert conf.count(f"hash {variable} consistent;") == 2
    assert conf.count("max_fails=") == conf.count("fail_timeout=") == 2 * len(COMPOSE_REPLICAS)
    assert "grpc_pass grpc://specsplit_grpc;" in conf and f"listen {COMPOSE_PORTS['balancer_grpc']} http2;" in conf


def test_the_balancer_bounds_slow_clients_and_logs_the_request_id() -> None:
    conf = compose_nginx_conf()
    for directive in ("client_header_timeout", "client_body_timeout", "send_timeout"):
        assert f"    {directive} " in conf, directive
    assert '"request_id":"$http_x_request_id"' in conf


def test_compose_profile_runs_the_replicas_behind_the_balancer(compose: dict[str, Any]) -> None:
    services = compose["services"]
    balancer = services["balancer"]
    assert balancer["profiles"] == ["replicas"] and balancer["image"].startswith("nginx:")
    assert "./deploy/nginx.conf:/etc/nginx/nginx.conf:ro" in balancer["volumes"]
    assert {int(p.split(":")[-1]) for p in balancer["ports"]} == {COMPOSE_PORTS["balancer_http"],
                                                                  COMPOSE_PORTS["balancer_grpc"]}
    for name in COMPOSE_REPLICAS:
        svc = services[name]
        env = svc["environment"]
        assert svc["profiles"] == ["replicas"] and balancer["depends_on"][name]["condition"] == "service_healthy"
        assert int(env["SPECSPLIT_CLOUD_HTTP_PORT"]) == COMPOSE_PORTS["http"]
        assert int(env["SPECSPLIT_CLOUD_GRPC_PORT"]) == COMPOSE_PORTS["grpc"]
        # docker stop waits longer than the replica's drain
        assert float(svc["stop_grace_period"].rstrip("s")) > float(env["SPECSPLIT_CLOUD_SHUTDOWN_GRACE_S"])
    assert "cloud" in services and "profiles" not in services["cloud"]  # `docker compose up` is unchanged


def test_nginx_accepts_the_configuration(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_conf(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3", "127.0.0.1:4"], "127.0.0.1:5",
                               "127.0.0.1:6", tmp_path))
    out = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf), "-e", str(tmp_path / "e.log")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
