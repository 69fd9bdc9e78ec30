"""The balancer's configuration: nginx directives that keep a generation on one replica by its routing key.

`nginx_conf` is the one place of the balancer's directives: bench/cluster.py runs a local nginx with it, and
deploy/nginx.conf (docker compose) is its rendering for the compose services (`compose_nginx_conf`). The access log
is JSON lines with the routing key and the upstream of every call (`is_session_call`, `last_upstream` read it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

# compose: the replica services and the ports they serve inside their containers
COMPOSE_REPLICAS = ("replica-1", "replica-2", "replica-3")
COMPOSE_PORTS = {"http": 8000, "grpc": 50051, "balancer_http": 8080, "balancer_grpc": 9090}

# a call counts as failed (connection refused / reset, no answer in time) this often within
# FAIL_TIMEOUT before nginx stops sending to that replica for FAIL_TIMEOUT
MAX_FAILS = 2
FAIL_TIMEOUT = "10s"

# the calls of a session (those that carry the routing key; GET /v1/model is per client, not per generation)
SESSION_URIS_REST = ("/v1/sessions", "/v1/verify")
SESSION_URIS_GRPC = ("/specsplit.v1.Verifier/OpenSession", "/specsplit.v1.Verifier/Verify",
                     "/specsplit.v1.Verifier/GetSession", "/specsplit.v1.Verifier/CloseSession",
                     "/specsplit.v1.Verifier/StreamSession")

_LOG_FORMAT = ('{"time":"$time_iso8601","route":"$http_x_specsplit_route","request_id":"$http_x_request_id",'
               '"method":"$request_method",'
               '"uri":"$uri","status":"$status","upstream":"$upstream_addr",'
               '"upstream_status":"$upstream_status","request_time":"$request_time"}')


def nginx_conf(rest_servers: Sequence[str], grpc_servers: Sequence[str], rest_listen: str, grpc_listen: str,
               runtime_dir: Path | None = None, fail_timeout: str = FAIL_TIMEOUT) -> str:
    """The balancer's nginx.conf. `runtime_dir`: where pid, logs and temp files go (a local, unprivileged
    nginx); None: the image's defaults with the log on the container's stdout (compose)."""
    if runtime_dir is None:
        paths = ["pid /tmp/nginx.pid;", "error_log /dev/stderr warn;"]
        http_paths = ["access_log /dev/stdout specsplit;"]
    else:
        d = runtime_dir
        paths = [f"pid {d}/nginx.pid;", f"error_log {d}/error.log warn;"]
        http_paths = [f"access_log {d}/access.log specsplit;"] + [
            f"{kind}_temp_path {d}/{kind}_temp;" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")]

    def upstream(name: str, servers: Sequence[str]) -> str:
        lines = "\n".join(f"        server {s} max_fails={MAX_FAILS} fail_timeout={fail_timeout};" for s in servers)
        return (f"    upstream {name} {{\n"
                f"        # the routing key of a generation picks its replica; on a failure, the next on the ring\n"
                f"        hash $http_x_specsplit_route consistent;\n{lines}\n        keepalive 32;\n"
                f"        # below the cloud's --keep-alive-s (75): nginx, not the replica, closes an idle pooled connection\n"
                f"        keepalive_timeout 60s;\n    }}\n")

    head = "\n".join(["# specsplit: verifier replicas behind nginx, sessions kept on their replica by the routing",
                      "# key (X-Specsplit-Route / x-specsplit-route). Rendered by bench/nginx_conf.py (nginx_conf).",
                      "worker_processes 1;", *paths, "", "events {", "    worker_connections 1024;", "}", ""])
    return head + f"""http {{
    log_format specsplit escape=json '{_LOG_FORMAT}';
{chr(10).join("    " + p for p in http_paths)}
    # the cloud answers 413 itself, in its own error format, past its max_body_bytes
    client_max_body_size 64m;
    # a client that trickles its headers or body is cut off here, before it holds a replica's connection
    client_header_timeout 10s;
    client_body_timeout 30s;
    send_timeout 60s;
    keepalive_timeout 75s;

{upstream("specsplit_rest", rest_servers)}
{upstream("specsplit_grpc", grpc_servers)}
    server {{
        listen {rest_listen};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        # a dead replica is found by its refused connection, a hung one by the header timeout
        proxy_connect_timeout 2s;
        proxy_send_timeout 30s;
        proxy_read_timeout 60s;
        proxy_next_upstream error timeout;
        proxy_next_upstream_tries 3;
        proxy_next_upstream_timeout 10s;

        location = /v1/verify {{
            # a round is idempotent (request_id): resent to the next replica when this one is down (that
            # one answers 404 and the edge reopens there) or draining and without the session (503)
            proxy_next_upstream error timeout http_503 non_idempotent;
            proxy_pass http://specsplit_rest;
        }}
        location = /v1/sessions {{
            # an open refused by a draining replica (503 + Retry-After) is tried on the next one
            proxy_next_upstream error timeout http_503 non_idempotent;
            proxy_pass http://specsplit_rest;
        }}
        location ~ ^/v1/sessions/[^/]+/stream$ {{
            # a session's stream of tokens: passed on as each comes (the cloud also says X-Accel-Buffering: no)
            proxy_next_upstream error timeout http_503;
            proxy_buffering off;
            proxy_pass http://specsplit_rest;
        }}
        location /v1/sessions/ {{
            proxy_next_upstream error timeout http_503;
            proxy_pass http://specsplit_rest;
        }}
        location = /v1/generate {{
            proxy_next_upstream error timeout http_503 non_idempotent;
            proxy_buffering off;
            proxy_pass http://specsplit_rest;
        }}
        location / {{
            proxy_pass http://specsplit_rest;
        }}
    }}

    server {{
        listen {grpc_listen} http2;
        grpc_connect_timeout 2s;
        grpc_send_timeout 30s;
        grpc_read_timeout 60s;
        grpc_next_upstream error timeout;
        grpc_next_upstream_tries 3;
        grpc_next_upstream_timeout 10s;

        location = /specsplit.v1.Verifier/Verify {{
            grpc_next_upstream error timeout non_idempotent;
            grpc_pass grpc://specsplit_grpc;
        }}
        location = /specsplit.v1.Verifier/OpenSession {{
            grpc_next_upstream error timeout non_idempotent;
            grpc_pass grpc://specsplit_grpc;
        }}
        location / {{
            grpc_pass grpc://specsplit_grpc;
        }}
    }}
}}
"""


def compose_nginx_conf() -> str:
    """deploy/nginx.conf: the balancer of docker-compose.yml's `replicas` profile."""
    p = COMPOSE_PORTS
    return nginx_conf([f"{r}:{p['http']}" for r in COMPOSE_REPLICAS], [f"{r}:{p['grpc']}" for r in COMPOSE_REPLICAS],
                      str(p["balancer_http"]), str(p["balancer_grpc"]))


def is_session_call(entry: dict[str, str]) -> bool:
    """An access log record of a session call (open, verify, get, close, stream; REST or gRPC)."""
    uri = entry["uri"]
    return uri.startswith(SESSION_URIS_REST) or uri in SESSION_URIS_GRPC


def last_upstream(entry: dict[str, str]) -> str:
    """The replica that answered: nginx lists every upstream it tried, the answering one last."""
    return entry["upstream"].split(",")[-1].strip()


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                            if os.access(p, os.X_OK)), None)
    if found is None:
        raise RuntimeError("nginx is not installed: apt-get install -y nginx (scripts/cluster.sh does it)")
    return found
