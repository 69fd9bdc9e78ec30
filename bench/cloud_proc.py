"""The cloud under test: one `specsplit-cloud` process on free loopback ports, REST readiness awaited."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
# unseeded by any test's random.seed
_PORTS = random.SystemRandom()
_GIVEN: set[int] = set()  # every port free_port has handed out in this process


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port free now, chosen below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) can be taken by any outgoing connection before the child that was given it binds it,
    or before a killed replica restarts on it."""
    lo = _ephemeral_range()[0]
    for _ in range(200):
        port = _PORTS.randrange(max(1024, lo - 20_000), lo)
        if port in _GIVEN:  # handed out already: its child may not have bound it yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cloud_command() -> list[str]:
    """The console script next to this interpreter, else on PATH, else `python -m cloud.cli`."""
    script = Path(sys.executable).parent / "specsplit-cloud"
    if script.exists():
        return [str(script)]
    found = shutil.which("specsplit-cloud")
    return [found] if found else [sys.executable, "-m", "cloud.cli"]


def under_torchrun(cmd: list[str], ranks: int) -> list[str]:
    """`cmd` as one tensor-parallel group of `ranks` local processes (`torchrun --standalone`: its own free
    rendezvous port); `cmd` itself for one rank."""
    if ranks <= 1:
        return cmd
    torchrun = Path(sys.executable).parent / "torchrun"
    return [str(torchrun) if torchrun.exists() else "torchrun", "--nproc-per-node", str(ranks), "--standalone",
            "--no-python", *cmd]


class CloudServer:
    """`specsplit-cloud --model DIR --device DEV` with `torch_threads` model threads, log in a temp file;
    `extra_args` are appended to the command line (e.g. `--dtype bfloat16`, `--max-batch-size 1`);
    `ranks` > 1 launches it under `torchrun --nproc-per-node ranks` (tensor-parallel verification)."""

    def __init__(self, model_dir: Path, device: str = "cpu", torch_threads: int = 1,
                 startup_timeout_s: float = 120.0, extra_args: list[str] | None = None, ranks: int = 1) -> None:
        self.ranks = ranks
        self.model_dir = Path(model_dir)
        self.device = device
        self.torch_threads = torch_threads
        self.extra_args = list(extra_args or [])
        self.startup_timeout_s = startup_timeout_s
        self.http_port = free_port()
        self.grpc_port = free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        fd, name = tempfile.mkstemp(prefix="specsplit-bench-cloud-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the cloud is not running"
        return self.proc.pid

    def start(self) -> CloudServer:
        cmd = [*cloud_command(), "--model", str(self.model_dir), "--host", "127.0.0.1",
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--device", self.device,
               "--torch-threads", str(self.torch_threads), "--log-level", "warning", *self.extra_args]
        cmd = under_torchrun(cmd, self.ranks)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specsplit-cloud exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"specsplit-cloud not ready after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> CloudServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
