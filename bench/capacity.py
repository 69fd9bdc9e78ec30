"""The cloud capacity section: how many tokens the verifier serves per CPU-second, alone.

The edges' CPU is taken out of the picture: the load comes from bench.loadgen, one asyncio
process replaying recorded verify traffic (bench.traces), so acceptance is the real drafters' and
the edges cost almost nothing. For each arm (a `specsplit-cloud` process started with that arm's
flags: batching on, and `--max-batch-size 1`, the one-session-per-forward path) and each mode
(speculative, cloud_only) the load runs at each session count, one case after another against
the one cloud. Per case: tokens, wall time, the cloud process's CPU time (/proc, as
bench.collectors.cpu_seconds), its peak RSS (VmHWM, reset per case), the KV gauge of /metrics
(polled), the batch histograms of /metrics when the cloud has them, and every round's latency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.cloud_proc import REPO, CloudServer
from bench.collectors import (
    GaugePoller,
    PeakRss,
    cpu_seconds,
    kv_bytes_per_token,
    machine_info,
    parse_prometheus,
    scrape,
)
from bench.loadgen import LoadResult, TextRun, run_load
from bench.plan import SAMPLINGS
from bench.traces import TRACES_DIR, Trace, load_dir, record_dir

log = logging.getLogger("bench.capacity")

MODES = ("speculative", "cloud_only")
# what the batching arm and the one-at-a-time arm add to the cloud's command line
BATCHED_FLAGS = "--max-batch-size 64 --max-batch-tokens 2048"
UNBATCHED_FLAGS = "--max-batch-size 1"
# generous admission limits, the same for both arms: a capacity case must never see a 429
ADMISSION_FLAGS = ["--max-sessions", "256", "--max-queue-depth", "512"]
# cloud /metrics series read before and after each case (counters and histogram sums / counts)
COUNTERS = ("specsplit_cloud_rounds_total", "specsplit_cloud_emitted_tokens_total",
            "specsplit_cloud_generated_tokens_total", "specsplit_cloud_prefill_ms_count",
            "specsplit_cloud_prefill_ms_sum", "specsplit_cloud_batch_size_sum", "specsplit_cloud_batch_size_count",
            "specsplit_cloud_batch_tokens_sum", "specsplit_cloud_batch_tokens_count",
            "specsplit_cloud_padded_equivalent_tokens_total")
KV_GAUGE = "specsplit_cloud_kv_bytes"
# seconds between two reads of the KV gauge (each read costs the cloud a /metrics render)
KV_POLL_S = 0.2
# seconds a cloud may take to start (a loaded shared machine can take minutes)
STARTUP_S = 600.0


@dataclass(frozen=True)
class CapacityPlan:
    # concurrent sessions of each case
    levels: tuple[int, ...] = (1, 4, 16, 64)
    # tokens per text (each text is cut after the round that reaches it)
    max_tokens: int = 128
    # arm name -> extra specsplit-cloud flags (shell words)
    arms: tuple[tuple[str, str], ...] = (("batched", BATCHED_FLAGS), ("max-batch-size 1", UNBATCHED_FLAGS))
    # session count the ratios are read at, and its baseline for the latency ratio
    ref_level: int = 16
    # torch device and dtype of the cloud
    device: str = "cpu"
    dtype: str = "float32"
    # prompts of each set the traces cover (only used when traces must be recorded)
    prompts_per_set: int = 2
    # tokens per recorded trace (only used when traces must be recorded)
    trace_tokens: int = 64
    # run the serving-core cases too (memory under a budget, prefix sharing, head-of-line; bench/serving.py)
    serving: bool = True

    @property
    def section_id(self) -> str:
        """Key of this run in results.json and BENCHMARKS.md: one section per device kind."""
        return "cpu" if self.device == "cpu" else "gpu"


def quick_capacity_plan(device: str = "cpu", dtype: str = "float32") -> CapacityPlan:
    return CapacityPlan(levels=(1, 2), max_tokens=6, ref_level=2, device=device, dtype=dtype, prompts_per_set=1,
                        trace_tokens=12, serving=False)


@dataclass
class CapacityRun:
    # arm name, mode, concurrent sessions
    arm: str
    mode: str
    sessions: int
    # wall time of the load, s; tokens committed over all texts
    wall_s: float
    tokens: int
    # CPU seconds of the cloud process and of the load generator over the case
    cloud_cpu_s: float
    client_cpu_s: float
    # VmHWM of the cloud during the case, and its RSS when the case began (what earlier cases left), bytes
    cloud_peak_rss: int
    # largest KV gauge read (bytes) and the reads made
    kv_peak_bytes: float
    kv_polls: int
    # KV the load needs at its peak: bytes per position x largest sum of running texts' positions
    kv_demand_bytes: int
    # deltas of COUNTERS over the case; a series the cloud does not export is missing
    counters: dict[str, float]
    # every text (bench.loadgen.TextRun as a dict)
    texts: list[dict[str, Any]] = field(default_factory=list)
    cloud_start_rss: int = 0

    def text_runs(self) -> list[TextRun]:
        return [TextRun(**t) for t in self.texts]


@dataclass
class CapacityResults:
    plan: CapacityPlan
    # the command, start time, machine, versions, GPU name, trace source, per-arm flags
    notes: dict[str, Any]
    runs: list[CapacityRun]
    total_s: float = 0.0
    # the serving-core cases (bench.serving.ServingResults as a dict; empty when not run)
    serving: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CapacityResults:
        p = d["plan"]
        p = {**p, "serving": p.get("serving", False)}
        plan = CapacityPlan(**{**p, "levels": tuple(p["levels"]), "arms": tuple(tuple(a) for a in p["arms"])})
        return cls(plan, d["notes"], [CapacityRun(**r) for r in d["runs"]], d.get("total_s", 0.0),
                   d.get("serving", {}))


def _round_floats(texts: list[TextRun]) -> list[dict[str, Any]]:
    out = []
    for t in texts:
        d = asdict(t)
        d["round_ms"] = [round(x, 2) for x in t.round_ms]
        d["open_ms"], d["start_s"], d["end_s"] = round(t.open_ms, 2), round(t.start_s, 4), round(t.end_s, 4)
        out.append(d)
    return out


def gpu_name(device: str) -> str:
    """The CUDA device's name via nvidia-smi, or '' on CPU / when it cannot be asked."""
    if device == "cpu":
        return ""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


class CapacityRunner:
    def __init__(self, plan: CapacityPlan, target: Path, draft: Path, traces_dir: Path = TRACES_DIR,
                 progress: Callable[[str], None] = lambda s: None) -> None:
        self.plan, self.target, self.draft, self.traces_dir = plan, Path(target), Path(draft), Path(traces_dir)
        self.progress = progress
        config = json.loads((self.target / "config.json").read_text())
        self.kv_per_position = kv_bytes_per_token(config, 2 if plan.dtype in ("bfloat16", "float16") else 4)

    def traces(self, cloud: CloudServer) -> tuple[list[Trace], str]:
        """The committed traces when they were recorded against this target, else fresh ones recorded
        against `cloud` (one session at a time, so batching plays no part in them)."""
        p = self.plan
        found = load_dir(self.traces_dir, self.target, p.device, p.dtype)
        if found is not None:
            return found, f"`{_rel(self.traces_dir)}` (recorded with `python -m bench.traces`)"
        out = Path(tempfile.mkdtemp(prefix="specsplit-traces-"))
        self.progress(f"no traces recorded against {self.target} on {p.device} / {p.dtype}: recording {2 * self.plan.prompts_per_set} "
                      "prompts x 2 drafters")
        record_dir(self.target, self.draft, out, p.prompts_per_set, p.trace_tokens, cloud.url, p.device, p.dtype)
        found = load_dir(out, self.target, p.device, p.dtype)
        assert found is not None
        return found, f"recorded at the start of this run against `{_rel(self.target)}` on {p.device} / {p.dtype}"

    def cloud_base_args(self) -> list[str]:
        return ["--dtype", self.plan.dtype, *ADMISSION_FLAGS]

    def _case(self, cloud: CloudServer, rss: PeakRss, arm: str, mode: str, n: int, traces: list[Trace]) -> CapacityRun:
        sampling = SAMPLINGS["greedy"]
        grpc_target = f"127.0.0.1:{cloud.grpc_port}"
        before = scrape(cloud.url)
        rss.reset()
        start_rss = rss.current_bytes()
        cpu0 = cpu_seconds(cloud.pid)
        # one keep-alive client for the polls: a fresh client per read costs this process milliseconds
        with httpx.Client(base_url=cloud.url, timeout=5.0) as http, GaugePoller(
                cloud.url, KV_GAUGE, KV_POLL_S, fetch=lambda _: parse_prometheus(http.get("/metrics").text)) as kv:
            res: LoadResult = asyncio.run(run_load(mode, traces, n, self.plan.max_tokens, sampling, grpc_target,
                                                   cloud.url))
        cloud_cpu = cpu_seconds(cloud.pid) - cpu0
        peak = rss.peak_bytes()
        after = scrape(cloud.url)
        counters = {c: after[c] - before.get(c, 0.0) for c in COUNTERS if c in after}
        return CapacityRun(arm=arm, mode=mode, sessions=n, wall_s=res.wall_s, tokens=sum(t.tokens for t in res.texts),
                           cloud_cpu_s=cloud_cpu, client_cpu_s=res.client_cpu_s, cloud_peak_rss=peak,
                           kv_peak_bytes=kv.peak, kv_polls=kv.samples,
                           kv_demand_bytes=res.peak_positions * self.kv_per_position, counters=counters,
                           texts=_round_floats(res.texts), cloud_start_rss=start_rss)

    def _arm(self, arm: str, cloud: CloudServer, traces: list[Trace], t_start: float) -> list[CapacityRun]:
        runs = []
        rss = PeakRss(cloud.pid)
        warm = min(4, max(self.plan.levels))
        for mode in MODES:  # warm-up, not measured: first forwards, connections, allocator
            asyncio.run(run_load(mode, traces, warm, 4, SAMPLINGS["greedy"], f"127.0.0.1:{cloud.grpc_port}",
                                 cloud.url, texts=warm))
        for mode in MODES:
            for n in self.plan.levels:
                run = self._case(cloud, rss, arm, mode, n, traces)
                runs.append(run)
                self.progress(f"[{time.perf_counter() - t_start:6.1f} s] capacity {arm} {mode} {n} sessions: "
                              f"{run.tokens} tokens, {run.tokens / max(run.cloud_cpu_s, 1e-9):.1f} "
                              f"tokens / cloud CPU-s, {run.wall_s:.1f} s")
        return runs

    def run(self, command: str) -> CapacityResults:
        """Both arms' clouds start together (one start-up wait); each is measured alone, then stopped,
        the other idle meanwhile. Traces missing for this target are recorded on the last arm's cloud."""
        t_start = time.perf_counter()
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        clouds = [CloudServer(self.target, self.plan.device, torch_threads=1, startup_timeout_s=STARTUP_S,
                              extra_args=[*self.cloud_base_args(), *shlex.split(flags)]) for _, flags in self.plan.arms]
        runs: list[CapacityRun] = []
        try:
            with ThreadPoolExecutor(len(clouds)) as pool:
                list(pool.map(CloudServer.start, clouds))
            traces, source = self.traces(clouds[-1])
            for (arm, flags), cloud in zip(self.plan.arms, clouds, strict=True):
                self.progress(f"capacity arm {arm!r}: specsplit-cloud {' '.join(self.cloud_base_args())} {flags}")
                runs += self._arm(arm, cloud, traces, t_start)
                cloud.stop()
        finally:
            for cloud in clouds:
                cloud.stop()
        serving: dict[str, Any] = {}
        if self.plan.serving and self.plan.device == "cpu":
            from bench.serving import run_serving

            serving = run_serving(self.target, self.progress).to_json()
        notes: dict[str, Any] = {
            "command": command, "started": started, "traces": source,
            "trace_names": [f"{t.drafter}:{t.prompt}" for t in traces],
            "machine": asdict(machine_info(0, 1)), "gpu": gpu_name(self.plan.device), "target": _rel(self.target),
            "cloud_args": " ".join(self.cloud_base_args()), "kv_per_position": self.kv_per_position,
        }
        return CapacityResults(self.plan, notes, runs, total_s=time.perf_counter() - t_start, serving=serving)


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)
