"""A local cluster without Docker: N `specsplit-cloud` replicas behind a stock nginx, on loopback.

    python -m bench.cluster 3 [--model DIR] [--http-port 8000] [--grpc-port 50051]   (scripts/cluster.sh)

nginx hashes the routing key of each call (REST header `X-Specsplit-Route`, gRPC metadata
`x-specsplit-route`) over the replicas with `hash ... consistent`, so every call of one generation
reaches the replica holding its session. When that replica fails, nginx moves the key to the next
replica on the ring; that one answers 404 and the edge reopens there with its committed context.
`nginx_conf` is the one place of the balancer's directives: deploy/nginx.conf (docker compose) is
its rendering for the compose services (`compose_nginx_conf`). The access log is JSON lines with
the routing key and the upstream of every call (`Nginx.access_log`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from bench.cloud_proc import cloud_command, free_port, under_torchrun
from bench.nginx_conf import FAIL_TIMEOUT, is_session_call, last_upstream, nginx_binary, nginx_conf

REPO = Path(__file__).resolve().parent.parent
DEMO_TARGET = REPO / "models" / "demo-target"
def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} not listening on {port} after {timeout_s} s:\n{_tail(log)}")


def _tail(path: Path, n: int = 30) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-n:])


def _stop(proc: subprocess.Popen[bytes] | None, sig: int, timeout_s: float) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Replica:
    """One `specsplit-cloud` child on free loopback ports; its JSON log lines in `log_path`.

    `kill()` is a crash (SIGKILL), `terminate()` a graceful drain (SIGTERM), `start()` again brings
    it back on the same ports with no sessions."""

    def __init__(self, model_dir: Path, index: int, runtime_dir: Path, extra_args: Sequence[str] = (),
                 torch_threads: int = 1, ranks: int = 1) -> None:
        self.model_dir, self.index, self.extra_args = Path(model_dir), index, tuple(extra_args)
        self.torch_threads = torch_threads
        self.ranks = ranks  # > 1: a tensor-parallel group under torchrun
        self.http_port = free_port()
        self.grpc_port = free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        self.log_path = runtime_dir / f"replica-{index}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def addresses(self) -> tuple[str, str]:
        """(REST, gRPC) as nginx writes them in $upstream_addr."""
        return f"127.0.0.1:{self.http_port}", f"127.0.0.1:{self.grpc_port}"

    def launch(self) -> None:
        """Start the process without waiting (see wait_ready)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        cmd = [*cloud_command(), "--model", str(self.model_dir), "--host", "127.0.0.1",
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--torch-threads", str(self.torch_threads), *self.extra_args]
        cmd = under_torchrun(cmd, self.ranks)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.index} exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
            if self.ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"replica {self.index} not ready after {timeout_s} s:\n{_tail(self.log_path)}")

    def ready(self) -> bool:
        try:
            return httpx.get(self.http_url + "/readyz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> Replica:
        self.launch()
        self.wait_ready()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap: a crash, nothing drained."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM without waiting: the replica drains, then exits (see `wait`)."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 30.0) -> int | None:
        """The exit code once the process ended; SIGKILL after `timeout_s`."""
        return _stop(self.proc, signal.SIGTERM, timeout_s) if self.proc is not None else None

    def log_events(self) -> list[dict[str, Any]]:
        """The replica's JSON log records (non-JSON lines skipped)."""
        out = []
        for line in (self.log_path.read_text(errors="replace") if self.log_path.exists() else "").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


class Nginx:
    """A stock nginx as a non-daemon child with its config, pid, logs and temp files in `runtime_dir`."""

    def __init__(self, runtime_dir: Path, rest_servers: Sequence[str], grpc_servers: Sequence[str],
                 http_port: int = 0, grpc_port: int = 0, fail_timeout: str = FAIL_TIMEOUT) -> None:
        self.runtime_dir = runtime_dir
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        self.conf_path = runtime_dir / "nginx.conf"
        self.conf_path.write_text(nginx_conf(rest_servers, grpc_servers, f"127.0.0.1:{self.http_port}",
                                             f"127.0.0.1:{self.grpc_port}", runtime_dir, fail_timeout))
        self.access_log_path = runtime_dir / "access.log"
        self.error_log_path = runtime_dir / "error.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        return [nginx_binary(), "-p", str(self.runtime_dir), "-c", str(self.conf_path), "-e",
                str(self.error_log_path), "-g", "daemon off;"]

    def start(self, timeout_s: float = 15.0) -> Nginx:
        out = self.runtime_dir / "nginx.out"
        with open(out, "ab") as f:
            self.proc = subprocess.Popen(self.command(), stdout=f, stderr=subprocess.STDOUT)
        for port in (self.http_port, self.grpc_port):
            _wait_port(port, self.proc, timeout_s, "nginx", out if out.stat().st_size else self.error_log_path)
        return self

    def stop(self) -> None:
        _stop(self.proc, signal.SIGQUIT, 10.0)  # SIGQUIT: graceful (finish the requests in flight)

    def access_log_size(self) -> int:
        return self.access_log_path.stat().st_size if self.access_log_path.exists() else 0

    def access_log(self, since: int = 0) -> list[dict[str, str]]:
        """The access log's records from byte offset `since` (see access_log_size)."""
        if not self.access_log_path.exists():
            return []
        with open(self.access_log_path, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def session_calls(self, since: int, expect: int, timeout_s: float = 10.0) -> list[dict[str, str]]:
        """The session calls logged from byte `since`, once `expect` of them are there (or `timeout_s` has
        passed). nginx writes a record after the answer has gone out, so a client can hold the answer to its
        last call before that call's record exists."""
        deadline = time.monotonic() + timeout_s
        while True:
            calls = [e for e in self.access_log(since) if is_session_call(e)]
            if len(calls) >= expect or time.monotonic() > deadline:
                return calls
            time.sleep(0.05)


@dataclass
class ClusterConfig:
    # replicas behind the balancer
    replicas: int = 3
    # target model directory of every replica
    model_dir: Path = DEMO_TARGET
    # more specsplit-cloud flags for every replica (e.g. ("--shutdown-grace-s", "5"))
    replica_args: tuple[str, ...] = ()
    # flags of one replica each, after replica_args (a shorter tuple: the rest have none)
    each_replica_args: tuple[tuple[str, ...], ...] = ()
    # torch threads per replica
    torch_threads: int = 1
    # balancer ports on 127.0.0.1; 0 picks free ones
    http_port: int = 0
    grpc_port: int = 0
    # how long nginx leaves a failed replica alone (nginx time syntax)
    fail_timeout: str = FAIL_TIMEOUT
    # tensor-parallel ranks of each replica (a shorter tuple: the rest have 1)
    ranks: tuple[int, ...] = ()


class Cluster:
    """`replicas` + nginx in a temp dir (removed by stop()); replicas start in parallel."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="specsplit-cluster-"))
        self.runtime_dir.chmod(0o755)  # nginx workers may run as another user than the master
        own = config.each_replica_args
        self.replicas = [Replica(config.model_dir, i + 1, self.runtime_dir,
                                 config.replica_args + (own[i] if i < len(own) else ()), config.torch_threads,
                                 config.ranks[i] if i < len(config.ranks) else 1) for i in range(config.replicas)]
        self.nginx = Nginx(self.runtime_dir, [r.addresses[0] for r in self.replicas],
                           [r.addresses[1] for r in self.replicas], config.http_port, config.grpc_port,
                           config.fail_timeout)

    def start(self) -> Cluster:
        try:
            for r in self.replicas:
                r.launch()
            for r in self.replicas:
                r.wait_ready()
            self.nginx.start()
        except BaseException:
            self.stop()
            raise
        return self

    def replica_at(self, upstream: str) -> Replica:
        """The replica behind an nginx upstream address (REST or gRPC port)."""
        for r in self.replicas:
            if upstream in r.addresses:
                return r
        raise KeyError(upstream)

    def holder_of(self, route_key: str, since: int = 0) -> Replica:
        """The replica that answered the latest successful session call with `route_key` (access log
        from byte `since`): the one holding that generation's session."""
        calls = [e for e in self.nginx.access_log(since)
                 if e["route"] == route_key and is_session_call(e) and e["status"] == "200"]
        if not calls:
            raise KeyError(f"no session call with route key {route_key} in the access log")
        return self.replica_at(last_upstream(calls[-1]))

    def stop(self, keep_files: bool = False) -> None:
        self.nginx.stop()
        for r in self.replicas:
            r.terminate()
        threads = [threading.Thread(target=r.wait, args=(30.0,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not keep_files:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cluster", description="N specsplit-cloud replicas behind nginx on 127.0.0.1; "
                                                            "Ctrl-C stops everything.")
    p.add_argument("replicas", type=int, nargs="?", default=3)
    p.add_argument("--model", type=Path, default=DEMO_TARGET, help="target model directory (default: the demo)")
    p.add_argument("--http-port", type=int, default=8000, help="balancer REST port (default 8000; 0 = free)")
    p.add_argument("--grpc-port", type=int, default=50051, help="balancer gRPC port (default 50051; 0 = free)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per replica (default 1)")
    p.epilog = "Flags after -- go to every specsplit-cloud replica (e.g. -- --shutdown-grace-s 20)."
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:cut])
    extra = tuple(argv[cut + 1:])
    if args.replicas < 1:
        print("cluster: need at least one replica", file=sys.stderr)
        return 2
    cluster = Cluster(ClusterConfig(args.replicas, args.model, extra, args.torch_threads, args.http_port,
                                    args.grpc_port))

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        cluster.start()
    except (RuntimeError, OSError) as e:
        print(f"cluster: cannot start: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    n = cluster.nginx
    print(f"specsplit cluster: {args.replicas} replica(s) of {args.model} behind nginx\n"
          f"  REST  {n.http_url}      specsplit-edge generate PROMPT --cloud {n.http_url}\n"
          f"  gRPC  {n.grpc_target}        specsplit-edge generate PROMPT --grpc {n.grpc_target}")
    for r in cluster.replicas:
        print(f"  replica {r.index}: REST {r.http_url}  gRPC 127.0.0.1:{r.grpc_port}  pid {r.proc.pid if r.proc else '-'}"
              f"  log {r.log_path}")
    print(f"  nginx access log (JSON, with the routing key): {n.access_log_path}\nCtrl-C stops everything.",
          flush=True)
    try:
        reported: set[int] = set()
        while n.proc is not None and n.proc.poll() is None:
            for r in cluster.replicas:
                if not r.alive() and r.index not in reported:  # e.g. killed to watch a failover
                    reported.add(r.index)
                    print(f"cluster: replica {r.index} exited; its sessions move to the others", file=sys.stderr)
            time.sleep(0.5)
        print("cluster: nginx exited; stopping the replicas", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ncluster: stopping (replicas drain first)", file=sys.stderr)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
