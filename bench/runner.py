"""Runs a plan: one cloud process, edge worker processes, delay proxies; returns raw measurements.

Layout on the machine: the cloud (`specsplit-cloud`, its model worker on `cloud_threads` torch
threads) and three edge worker processes (`bench.edge_worker`: one that only talks to the cloud,
one with the n-gram drafter, one with the draft model), each measured on its own. Round-trip
delays are injected by `bench.delay_proxy` (a loopback TCP proxy in this process), never inside
the edge. Repeats are interleaved (repeat 1 of every case, then repeat 2, ...) so slow drift of
the machine's load spreads over all cases.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from bench.cloud_proc import REPO, CloudServer
from bench.collectors import (
    GaugePoller,
    MachineInfo,
    PeakRss,
    cpu_seconds,
    kv_bytes_per_token,
    machine_info,
    ping_ms,
    scrape,
)
from bench.delay_proxy import DelayProxy
from bench.plan import SAMPLINGS, Case, Plan

PROMPTS = Path(__file__).resolve().parent / "prompts"
# counters of the cloud's /metrics read before and after every case
CLOUD_COUNTERS = ("specsplit_cloud_rounds_total", "specsplit_cloud_generated_tokens_total",
                  "specsplit_cloud_drafted_tokens_total", "specsplit_cloud_accepted_tokens_total",
                  "specsplit_cloud_target_forward_seconds_count", "specsplit_cloud_target_forward_seconds_sum")
KV_GAUGE = "specsplit_cloud_kv_bytes"
# seconds between two reads of KV_GAUGE during a case (each read costs the cloud a /metrics render)
KV_POLL_S = 0.1
# seconds kept for analysis, figures and the report when checking the time budget
REPORT_RESERVE_S = 20.0
# seed of prompt i (the same in every mode, so modes see the same draws where they can)
SEED_BASE = 1000


@dataclass
class Prompt:
    # "code/copy.py", "prose/lighthouse"
    name: str
    # token ids (left-truncated to fit the model's context)
    ids: list[int]


@dataclass
class CaseRun:
    # Case.key and the repeat index (0-based)
    key: str
    repeat: int
    # wall time of the whole job in the edge worker (all sessions), ms
    wall_ms: float
    # edge worker: peak RSS during the job, CPU seconds used
    edge_peak_rss: int
    edge_cpu_s: float
    # cloud process: peak RSS during the job (VmHWM after a reset), CPU seconds used
    cloud_peak_rss: int
    cloud_cpu_s: float
    # largest KV cache bytes the cloud reported (its /metrics gauge, polled) and the polls made
    kv_peak_bytes: float
    kv_polls: int
    # deltas of CLOUD_COUNTERS over the job
    cloud_counters: dict[str, float]
    # bytes through the delay proxy (HTTP headers included); 0 at direct loopback
    wire_up: int
    wire_down: int
    # one dict per generation (see bench.edge_worker)
    generations: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Calibration:
    # ms of GET /healthz per path: "direct" and "rtt<ms>" through the proxy (all samples)
    ping_ms: dict[str, list[float]]
    # target forward + draw per token in target-only decoding, per sampling (cloud-side decode_ms / tokens),
    # measured before every repeat
    t_target_ms: dict[str, list[float]]
    # per prompt (index into RunResults.prompts): cloud-side time of the first target step (prefill), ms
    prefill_ms: list[float]
    # KV bytes per cached position, from the target's config
    kv_bytes_per_token: int


@dataclass
class RunResults:
    machine: MachineInfo
    plan: Plan
    prompts: list[Prompt]
    calibration: Calibration
    runs: list[CaseRun]
    # how each peak was measured (reset support), and where delays were injected
    notes: dict[str, str]
    started: str
    total_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunResults:
        """Inverse of to_json (re-render a report without rerunning)."""
        plan = d["plan"]
        return cls(machine=MachineInfo(**d["machine"]),
                   plan=Plan(prompts_per_set=plan["prompts_per_set"], max_new_tokens=plan["max_new_tokens"],
                             cases=[Case(**c) for c in plan["cases"]], main_k=plan["main_k"],
                             warmup=plan.get("warmup", True)),
                   prompts=[Prompt(**p) for p in d["prompts"]],
                   calibration=Calibration(**{**d["calibration"], "t_target_ms": {
                       k: v if isinstance(v, list) else [v] for k, v in d["calibration"]["t_target_ms"].items()}}),
                   runs=[CaseRun(**r) for r in d["runs"]], notes=d["notes"], started=d["started"],
                   total_s=d.get("total_s", 0.0))


def rel_to_repo(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def load_prompts(per_set: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind in ("code", "prose"):
        lines = (PROMPTS / f"{kind}.jsonl").read_text().splitlines()
        for line in lines[:per_set]:
            row = json.loads(line)
            out.append((f"{kind}/{row['id']}", row["text"]))
    return out


def tokenize_prompts(target_dir: Path, texts: list[tuple[str, str]], keep: int) -> list[Prompt]:
    """The target's tokenizer.json (the `tokenizers` library, as the fast Hugging Face tokenizer the
    edge uses: same ids), keeping the last `keep` tokens of each prompt."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [Prompt(name, list(tok.encode(text).ids)[-keep:]) for name, text in texts]


class EdgeWorker:
    """A `python -m bench.edge_worker` child: one JSON job per line in, one answer per line out."""

    def __init__(self, name: str, torch_threads: int, log_dir: Path, preload: list[str], tokenizer: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"edge-{name}.log"
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "bench.edge_worker", "--torch-threads", str(torch_threads),
               "--tokenizer", str(tokenizer)]
        for d in preload:
            cmd += ["--preload", d]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=REPO)
        self.pid = self.proc.pid

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"edge worker {self.name} gave no answer (exit {self.proc.poll()}):\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"edge worker {self.name} failed:\n{answer.get('error')}")
        return answer

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        self._read(timeout_s)

    def run(self, job: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def worker_kind(case: Case, shared: bool = False) -> str:
    """Edge worker process of a case: one per drafter kind (honest edge RSS), plus one for the
    multi-session model-drafter cases (their 16 drafter states would raise the others' peaks); or
    one process for everything."""
    if shared:
        return "all"
    if case.part == "concurrency" and case.drafter == "model":
        return "model-sessions"
    return case.drafter or "none"


class Runner:
    def __init__(self, plan: Plan, target: Path, draft: Path, device: str = "cpu", edge_threads: int = 1,
                 cloud_threads: int = 1, shared_worker: bool = False, budget_s: float = 0.0,
                 progress: Callable[[str], None] = lambda s: None) -> None:
        self.plan, self.target, self.draft, self.device = plan, Path(target), Path(draft), device
        # one edge worker process for every case (faster start; edge RSS then mixes drafters)
        self.shared_worker = shared_worker
        # whole-run time budget (0 = none): later repeats that would overrun it are skipped
        self.budget_s = budget_s
        self._warm: set[tuple[object, ...]] = set()
        self.edge_threads, self.cloud_threads, self.progress = edge_threads, cloud_threads, progress
        self.config = json.loads((self.target / "config.json").read_text())
        self.n_ctx = int(self.config.get("n_positions") or self.config.get("max_position_embeddings") or 1024)

    # -- set-up -----------------------------------------------------------------------------------

    def _prompts(self) -> list[Prompt]:
        # room for the new tokens, the largest draft block and its bonus
        keep = self.n_ctx - self.plan.max_new_tokens - 16 - 2
        return tokenize_prompts(self.target, load_prompts(self.plan.prompts_per_set), keep)

    def _calibrate(self, cloud: CloudServer, proxies: dict[float, DelayProxy], prompts: list[Prompt],
                   n_ping: int) -> Calibration:
        pings = {"direct": ping_ms(cloud.url + "/healthz", n_ping)}
        for rtt, proxy in proxies.items():
            pings[f"rtt{rtt:g}"] = ping_ms(proxy.url + "/healthz", n_ping)
        t_target = {name: [ms] for name, ms in self._t_target(cloud, prompts, warm=True).items()}
        with httpx.Client(base_url=cloud.url, timeout=300.0) as http:
            prefill = []
            for i, p in enumerate(prompts):
                body = {"prompt_ids": p.ids, "sampling_cfg": SAMPLINGS["greedy"], "seed": SEED_BASE + i,
                        "max_new_tokens": 1, "stop_at_eos": False}
                prefill.append(float(http.post("/v1/generate", json=body).raise_for_status().json()
                                     ["metrics"]["prefill_ms"]))
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(self.config.get("dtype", "float32")), 4)
        return Calibration(pings, t_target, prefill, kv_bytes_per_token(self.config, dtype_bytes))

    def _t_target(self, cloud: CloudServer, prompts: list[Prompt], warm: bool) -> dict[str, float]:
        """Cloud-side decode ms per token of POST /v1/generate on the first two prompts, per sampling."""
        out: dict[str, float] = {}
        with httpx.Client(base_url=cloud.url, timeout=300.0) as http:
            for name, cfg in SAMPLINGS.items():
                per_token = []
                passes = prompts[:2] * 2 if warm else prompts[:2]  # a first pass warms the cloud up
                for i, p in enumerate(passes):
                    body = {"prompt_ids": p.ids, "sampling_cfg": cfg, "seed": SEED_BASE + i,
                            "max_new_tokens": self.plan.max_new_tokens, "stop_at_eos": False}
                    m = http.post("/v1/generate", json=body).raise_for_status().json()["metrics"]
                    if (i >= 2 or not warm) and m["tokens"] > 1:
                        per_token.append(m["decode_ms"] / (m["tokens"] - 1))
                out[name] = median(per_token)
        return out

    # -- one case ---------------------------------------------------------------------------------

    def _preload(self, kind: str) -> list[str]:
        """Drafters a worker loads while the cloud starts."""
        return {"model": [str(self.draft)], "model-sessions": [str(self.draft)], "ngram": ["ngram"], "none": [],
                "all": [str(self.draft), "ngram"]}[kind]

    def _work(self, case: Case, prompts: list[Prompt]) -> list[list[dict[str, Any]]]:
        """Per session: the (prompt, seed) list it generates, in order."""
        n = len(prompts)
        if case.per_session <= 0:  # one session walks the whole set
            return [[{"prompt": i, "prompt_ids": p.ids, "seed": SEED_BASE + i} for i, p in enumerate(prompts)]]
        out = []
        for s in range(case.sessions):
            idx = [(s * case.per_session + j) % n for j in range(case.per_session)]
            out.append([{"prompt": i, "prompt_ids": prompts[i].ids, "seed": SEED_BASE + i} for i in idx])
        return out

    def _job(self, case: Case, url: str, work: list[list[dict[str, Any]]], max_new: int) -> dict[str, Any]:
        draft = {"model": str(self.draft), "ngram": "ngram", None: None}[case.drafter]
        return {"cloud_url": url, "mode": case.mode, "draft": draft, "tokenizer": str(self.target),
                "sampling": SAMPLINGS[case.sampling], "fixed_k": case.fixed_k, "max_new_tokens": max_new,
                "k_policy": case.k_policy, "draft_ahead": case.draft_ahead, "sessions": work}

    def _run_case(self, case: Case, repeat: int, worker: EdgeWorker, cloud: CloudServer, cloud_rss: PeakRss,
                  url: str, proxy: DelayProxy | None, prompts: list[Prompt]) -> CaseRun:
        work = self._work(case, prompts)
        warm_key = (worker.name, case.mode, case.drafter, case.sampling, case.sessions, url)
        if self.plan.warmup and warm_key not in self._warm:  # every session slot once, a few tokens, not measured
            worker.run(self._job(case, url, [w[:1] for w in work], 4))
            self._warm.add(warm_key)
        job = self._job(case, url, work, self.plan.max_new_tokens)
        before = scrape(cloud.url)
        wire0 = (proxy.counters.bytes_up, proxy.counters.bytes_down) if proxy else (0, 0)
        cloud_rss.reset()
        cpu0 = cpu_seconds(cloud.pid)
        with GaugePoller(cloud.url, KV_GAUGE, KV_POLL_S) as kv:
            ans = worker.run(job)
        cloud_cpu = cpu_seconds(cloud.pid) - cpu0
        cloud_peak = cloud_rss.peak_bytes()
        after = scrape(cloud.url)
        wire1 = (proxy.counters.bytes_up, proxy.counters.bytes_down) if proxy else (0, 0)
        return CaseRun(key=case.key, repeat=repeat, wall_ms=ans["wall_ms"], edge_peak_rss=ans["peak_rss_bytes"],
                       edge_cpu_s=ans["cpu_s"], cloud_peak_rss=cloud_peak, cloud_cpu_s=cloud_cpu,
                       kv_peak_bytes=kv.peak, kv_polls=kv.samples,
                       cloud_counters={c: after.get(c, 0.0) - before.get(c, 0.0) for c in CLOUD_COUNTERS},
                       wire_up=wire1[0] - wire0[0], wire_down=wire1[1] - wire0[1], generations=ans["generations"])

    def _run_all(self, t_start: float, cloud: CloudServer, workers: dict[str, EdgeWorker],
                 proxies: dict[float, DelayProxy], prompts: list[Prompt],
                 calib: Calibration) -> tuple[list[CaseRun], list[str]]:
        """Repeat-major order. A repeat after the first is skipped when the time it took the first
        time would end the run past the budget; the skipped ones are returned."""
        cloud_rss = PeakRss(cloud.pid)
        runs: list[CaseRun] = []
        took: dict[str, float] = {}
        skipped: list[str] = []
        for rep in range(max(c.repeats for c in self.plan.cases)):
            if rep > 0:
                for name, ms in self._t_target(cloud, prompts, warm=False).items():
                    calib.t_target_ms[name].append(ms)
            for case in self.plan.cases:
                if rep >= case.repeats:
                    continue
                elapsed = time.perf_counter() - t_start
                if rep > 0 and self.budget_s and elapsed + took[case.key] + REPORT_RESERVE_S > self.budget_s:
                    skipped.append(f"{case.key} repeat {rep + 1}")
                    continue
                t0 = time.perf_counter()
                proxy = proxies.get(case.rtt_ms)
                worker = workers[worker_kind(case, self.shared_worker)]
                runs.append(self._run_case(case, rep, worker, cloud, cloud_rss, proxy.url if proxy else cloud.url,
                                           proxy, prompts))
                took.setdefault(case.key, time.perf_counter() - t0)
                self.progress(f"[{time.perf_counter() - t_start:6.1f} s] repeat {rep + 1} {case.key} "
                              f"({time.perf_counter() - t0:.1f} s)")
        if skipped:
            self.progress(f"time budget {self.budget_s:.0f} s: skipped {len(skipped)} later repeats")
        return runs, skipped

    # -- the whole plan ---------------------------------------------------------------------------

    def run(self, n_ping: int = 20) -> RunResults:
        t_start = time.perf_counter()
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        info = machine_info(self.edge_threads, self.cloud_threads)
        log_dir = Path(tempfile.mkdtemp(prefix="specsplit-bench-"))
        kinds = sorted({worker_kind(c, self.shared_worker) for c in self.plan.cases})
        cloud = CloudServer(self.target, self.device, self.cloud_threads)
        workers: dict[str, EdgeWorker] = {}
        proxies: dict[float, DelayProxy] = {}
        try:
            self.progress(f"starting the cloud ({self.target}, {self.device}) and {len(kinds)} edge workers")
            workers = {k: EdgeWorker(k, self.edge_threads, log_dir, self._preload(k), self.target) for k in kinds}
            cloud.start()
            for w in workers.values():
                w.wait_ready()
            prompts = self._prompts()
            for rtt in sorted({c.rtt_ms for c in self.plan.cases if c.rtt_ms > 0}):
                proxies[rtt] = DelayProxy("127.0.0.1", cloud.http_port, rtt).start()
            calib = self._calibrate(cloud, proxies, prompts, n_ping)
            self.progress(f"set-up done in {time.perf_counter() - t_start:.1f} s; target "
                          + ", ".join(f"{k} {v[0]:.2f} ms/token" for k, v in calib.t_target_ms.items()))
            edge_rss_ok = PeakRss(next(iter(workers.values())).pid).resettable
            runs, skipped = self._run_all(t_start, cloud, workers, proxies, prompts, calib)
            cloud_resettable = PeakRss(cloud.pid).resettable
            notes = {
                "delay": "injected by bench/delay_proxy.py: a loopback TCP proxy adding rtt/2 to each direction",
                "edge_rss": ("VmHWM of the one edge worker process that ran every case (drafters of earlier "
                             "cases stay loaded)" if self.shared_worker else
                             "VmHWM of the edge worker process (python + torch + tokenizer + drafter + its "
                             "HTTP clients; one process per drafter kind, another for the multi-session "
                             "cases)") + ", reset per case"
                            + ("" if edge_rss_ok else " (reset refused: from start)"),
                "cloud_rss": "VmHWM of the specsplit-cloud process, reset per case"
                             + ("" if cloud_resettable else " (reset refused: from process start)"),
                "kv": f"largest {KV_GAUGE} of GET /metrics, polled every {KV_POLL_S * 1000:g} ms during the case",
                "device": self.device, "target": rel_to_repo(self.target), "draft": rel_to_repo(self.draft),
                "skipped": "; ".join(skipped),
            }
            return RunResults(info, self.plan, prompts, calib, runs, notes, started,
                              total_s=time.perf_counter() - t_start)
        finally:
            for p in proxies.values():
                p.stop()
            for w in workers.values():
                w.stop()
            cloud.stop()
