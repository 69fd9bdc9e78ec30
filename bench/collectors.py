"""What the benchmark reads off running processes: peak RSS, CPU time, the cloud's /metrics, machine info.

Peak RSS is the kernel's VmHWM (`/proc/PID/status`), reset between measurements by writing 5 to
`/proc/PID/clear_refs` (Linux >= 4.0). Where the reset is refused the peak counts from process
start, and `PeakRss.resettable` says so. CPU time is utime + stime of `/proc/PID/stat`.
"""

from __future__ import annotations

import os
import platform
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def status_kib(pid: int, key: str) -> int:
    """A `kB` field of /proc/PID/status (VmHWM, VmRSS, ...), in KiB; 0 when missing."""
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) if m else 0


class PeakRss:
    """Peak resident memory of one process, with reset between measurements."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.resettable = self.reset()

    def reset(self) -> bool:
        """Start a new peak at the current RSS; False when the kernel refuses."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def peak_bytes(self) -> int:
        return status_kib(self.pid, "VmHWM") * 1024

    def current_bytes(self) -> int:
        return status_kib(self.pid, "VmRSS") * 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after the ")" of comm, field 3 (state) is index 0: utime is field 14, stime field 15
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value} (comments dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                continue
    return out


def scrape(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """The cloud's GET /metrics, parsed."""
    return parse_prometheus(httpx.get(base_url + "/metrics", timeout=timeout).text)


def metric_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


class GaugePoller:
    """Polls one gauge of the cloud's /metrics in a thread and keeps the largest value seen."""

    def __init__(self, base_url: str, name: str, period_s: float = 0.05,
                 fetch: Callable[[str], dict[str, float]] = scrape) -> None:
        self.base_url, self.name, self.period_s, self.fetch = base_url, name, period_s, fetch
        self.peak = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.fetch(self.base_url).get(self.name, 0.0))
                self.samples += 1
            except httpx.HTTPError:
                pass
            self._stop.wait(self.period_s)

    def __enter__(self) -> GaugePoller:
        self._thread = threading.Thread(target=self._loop, name="gauge-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


def kv_bytes_per_token(config: Mapping[str, object], dtype_bytes: int = 4) -> int:
    """Bytes one cached position takes in a decoder's KV cache: K and V, every layer, every kv head.

    Reads the usual Hugging Face config names (GPT-2's n_layer / n_embd / n_head too).
    """
    def get(*names: str) -> int | None:
        for n in names:
            v = config.get(n)
            if isinstance(v, int):
                return v
        return None

    layers = get("num_hidden_layers", "n_layer")
    hidden = get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    if layers is None or hidden is None or heads is None:
        raise ValueError("config lacks layer / hidden size / head counts")
    head_dim = get("head_dim") or hidden // heads
    kv_heads = get("num_key_value_heads") or heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass
class MachineInfo:
    # CPU model name (/proc/cpuinfo)
    cpu_model: str
    # logical CPUs the OS reports, and those this process may run on
    cpus: int
    cpus_usable: int
    # torch intra-op threads of the edge worker and of the cloud's model worker
    torch_threads_edge: int
    torch_threads_cloud: int
    # 1-minute load average at start (other work on the machine)
    load_avg_1m: float
    # versions of the things that set the speed
    versions: dict[str, str] = field(default_factory=dict)
    platform: str = ""


def machine_info(torch_threads_edge: int, torch_threads_cloud: int) -> MachineInfo:
    import importlib.metadata as md

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "fastapi", "uvicorn", "httpx", "numpy", "matplotlib"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "-"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return MachineInfo(cpu_model=cpu, cpus=os.cpu_count() or 1, cpus_usable=usable,
                       torch_threads_edge=torch_threads_edge, torch_threads_cloud=torch_threads_cloud,
                       load_avg_1m=os.getloadavg()[0], versions=versions, platform=platform.platform())


def ping_ms(url: str, n: int = 20, timeout: float = 5.0) -> list[float]:
    """Round-trip times of GET url (keep-alive, after one warm-up), ms."""
    out: list[float] = []
    with httpx.Client(timeout=timeout) as client:
        client.get(url)
        for _ in range(n):
            t0 = time.perf_counter()
            client.get(url)
            out.append((time.perf_counter() - t0) * 1000.0)
    return out
