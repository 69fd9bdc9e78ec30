"""Start the real `specsplit-cloud` process on free loopback ports, for end-to-end tests.

    with CloudProcess(model_dir, api_keys=("k1",)) as cloud:
        httpx.get(cloud.http_url + "/readyz")
        grpc.insecure_channel(cloud.grpc_target)

`start()` (or entering the context) waits until REST /readyz answers 200 and the gRPC health
service says SERVING; a process that exits or never gets ready raises RuntimeError with the tail
of its log. `restart()` brings it back on the same ports (sessions are gone: they live in memory).
The process log (JSON lines) is kept in `log_path` while the object lives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cloud_proc import cloud_command, free_port

REPO = Path(__file__).resolve().parent.parent


class CloudProcess:
    """A `specsplit-cloud` child process on 127.0.0.1.

    model_dir: target model directory; api_keys: keys that turn auth on; extra_args: more CLI
    flags (e.g. ("--max-sessions", "4")); env: extra environment variables. By default the model
    worker uses one torch thread (SPECSPLIT_CLOUD_TORCH_THREADS=1), which is fastest on a small
    shared machine; pass env={"SPECSPLIT_CLOUD_TORCH_THREADS": "0"} for torch's default. The dtype is
    float32 (the references tests compare with are float32) unless SPECSPLIT_TEST_DTYPE names another or a
    test passes --dtype.
    """

    def __init__(self, model_dir: str | Path, api_keys: Sequence[str] = (), extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 90.0) -> None:
        self.model_dir = Path(model_dir)
        self.api_keys = tuple(api_keys)
        self.extra_args = tuple(extra_args)
        self.env = {"SPECSPLIT_CLOUD_TORCH_THREADS": "1",
                    # the runner the suite runs against: PyTorch unless SPECSPLIT_TEST_RUNNER=llamacpp (then every
                    # tiny target is served from a GGUF of its weights, `gguf_of`)
                    "SPECSPLIT_CLOUD_RUNNER": os.environ.get("SPECSPLIT_TEST_RUNNER", "torch"),
                    "SPECSPLIT_CLOUD_DTYPE": os.environ.get("SPECSPLIT_TEST_DTYPE", "float32"), **(env or {})}
        llama = self.env["SPECSPLIT_CLOUD_RUNNER"] == "llamacpp" or "llamacpp" in self.extra_args
        if llama:  # llama.cpp runs the GGUF's own types: a --dtype is refused there
            self.env["SPECSPLIT_CLOUD_DTYPE"] = "auto"
        self.startup_timeout_s = startup_timeout_s
        self.host = "127.0.0.1"
        self.http_port = free_port()
        self.grpc_port = free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="specsplit-cloud-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def auth_headers(self, key: str | None = None) -> dict[str, str]:
        """REST headers for `key` (default: the first configured key; none when auth is off)."""
        key = key if key is not None else (self.api_keys[0] if self.api_keys else None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def grpc_metadata(self, key: str | None = None) -> tuple[tuple[str, str], ...]:
        key = key if key is not None else (self.api_keys[0] if self.api_keys else None)
        return (("authorization", f"Bearer {key}"),) if key else ()

    def command(self) -> list[str]:
        model = self.model_dir
        if os.environ.get("SPECSPLIT_TEST_RUNNER") == "llamacpp" and model.is_dir():
            model = gguf_of(model)
        args = [*cloud_command(), "--model", str(model), "--host", self.host,
                "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        for k in self.api_keys:
            args += ["--api-key", k]
        return args + list(self.extra_args)

    def start(self) -> CloudProcess:
        if self.proc is not None and self.proc.poll() is None:
            return self
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        log = open(self.log_path, "ab")  # the child keeps its own descriptor
        try:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"specsplit-cloud exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._http_ready() and self._grpc_serving():
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"specsplit-cloud not ready after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def _http_ready(self) -> bool:
        try:
            return httpx.get(self.http_url + "/readyz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _grpc_serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.grpc_target) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait for a clean exit (SIGKILL after `timeout_s`); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL at once (a crash: nothing is drained)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> CloudProcess:
        """stop() then start() on the same ports; every session is gone afterwards."""
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def __enter__(self) -> CloudProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)


def gguf_of(model_dir: Path) -> Path:
    """A float32 GGUF of the (GPT-2 or Qwen2) model in `model_dir`, with its tokenizer beside it, written once per
    directory into a directory of the temporary folder named after its path (tests/tiny_gguf.py)."""
    import hashlib

    from tests.tiny_gguf import write_gguf

    weights = model_dir / "model.safetensors"
    stamp = f"{model_dir.resolve()}:{weights.stat().st_mtime_ns if weights.exists() else 0}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "specsplit-test-gguf" / f"{model_dir.name}-{key}"
    if not (out / "model.gguf").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                (out / f.name).write_bytes(f.read_bytes())
        write_gguf(model_dir, out / "partial.gguf").rename(out / "model.gguf")
    return out / "model.gguf"
