"""The report's figures (matplotlib, Agg backend, PNG): speedup vs RTT, accepted-length histogram,
acceptance vs k, cloud throughput vs sessions. Each function writes one file and returns its path."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.plan import Case  # noqa: E402
from bench.stats import Analysis, CaseSummary, Stat, rtt_of  # noqa: E402

DPI = 110
FILES = {"rtt": "speedup_vs_rtt.png", "hist": "accepted_length_hist.png", "k": "acceptance_vs_k.png",
         "sessions": "cloud_throughput_vs_sessions.png"}


def _err(stats: list[Stat]) -> list[list[float]]:
    return [[s.mid - s.lo for s in stats], [s.hi - s.mid for s in stats]]


def rtt_series(an: Analysis, drafter: str, sampling: str) -> list[tuple[float, CaseSummary]]:
    """(rtt, summary) of speculative dynamic-k cases; rtt 0 is the main table's loopback case."""
    out = []
    main = an.get(Case("main", "speculative", drafter, sampling, None))
    if main is not None:
        out.append((0.0, main))
    for s in an.summaries.values():
        c = s.case
        if c.part == "rtt" and c.drafter == drafter and c.sampling == sampling and c.mode == "speculative":
            out.append((c.rtt_ms, s))
    return sorted(out, key=lambda x: x[0])


def plot_speedup_vs_rtt(an: Analysis, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (drafter, sampling), colour in zip([("model", "greedy"), ("model", "sampled"), ("ngram", "greedy")],
                                           ["C0", "C1", "C2"], strict=True):
        pts = [(r, s) for r, s in rtt_series(an, drafter, sampling) if s.speedup is not None]
        if not pts:
            continue
        xs = [rtt_of(an.results, r) for r, _ in pts]
        stats = [s.speedup for _, s in pts if s.speedup is not None]
        ax.errorbar(xs, [s.mid for s in stats], yerr=_err(stats), marker="o", capsize=3, color=colour,
                    label=f"spec-{drafter}, {sampling}")
        bounds = [s.bound for _, s in pts if s.bound is not None]
        if len(bounds) == len(pts):
            ax.plot(xs, bounds, linestyle="--", color=colour, alpha=0.7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("measured round-trip time, GET /healthz p50 (ms)")
    ax.set_ylabel("speedup over cloud_only (tokens/s ratio)")
    ax.set_title("Speedup vs round-trip time (1 session, dynamic k; dashed: bound)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, out / FILES["rtt"])


def plot_accepted_hist(an: Analysis, out: Path) -> Path:
    k = an.results.plan.main_k
    rows = [(d, sm) for d in ("model", "ngram") for sm in ("greedy", "sampled")]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.8 / len(rows)
    for i, (drafter, sampling) in enumerate(rows):
        s = an.get(Case("main", "speculative", drafter, sampling, k))
        if s is None or s.acc is None:
            continue
        hist = s.acc.histogram.get(k, {})  # rounds that drafted the full k (not the n-gram's shorter ones)
        total = sum(hist.values())
        if not total:
            continue
        xs = list(range(k + 1))
        shares = [hist.get(x, 0) / total for x in xs]
        ax.bar([x + (i - (len(rows) - 1) / 2) * width for x in xs], shares, width=width,
               label=f"spec-{drafter}, {sampling} (a = {s.acc.a:.2f}, {total} rounds)", color=f"C{i}")
        a = s.acc.a  # geometric law of La under a constant per-position acceptance a
        theory = [a**x * (1 - a) for x in range(k)] + [a**k]
        ax.plot([x + (i - (len(rows) - 1) / 2) * width for x in xs], theory, "k.", markersize=4)
    ax.set_xlabel(f"accepted length La per round (rounds that drafted k = {k})")
    ax.set_ylabel("share of verified rounds")
    ax.set_title("Accepted-length histogram (dots: a^La (1 - a), a^k for La = k)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / FILES["hist"])


def k_series(an: Analysis, sampling: str) -> list[tuple[int, CaseSummary]]:
    out = []
    for s in an.summaries.values():
        c = s.case
        if (c.mode == "speculative" and c.drafter == "model" and c.sampling == sampling and c.fixed_k is not None
                and c.part in ("k", "main")):
            out.append((c.fixed_k, s))
    return sorted(out, key=lambda x: x[0])


def plot_acceptance_vs_k(an: Analysis, out: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    for sampling, colour in (("greedy", "C0"), ("sampled", "C1")):
        pts = [(k, s) for k, s in k_series(an, sampling) if s.acc is not None]
        if not pts:
            continue
        ks = [k for k, _ in pts]
        left.plot(ks, [s.acc.a for _, s in pts if s.acc], "o-", color=colour, label=f"a, {sampling}")
        left.plot(ks, [s.acc.rate for _, s in pts if s.acc], "s:", color=colour, alpha=0.6,
                  label=f"accepted / drafted, {sampling}")
        right.plot(ks, [s.acc.tokens_per_round for _, s in pts if s.acc], "o-", color=colour,
                   label=f"measured, {sampling}")
        right.plot(ks, [s.acc.predicted_tokens_per_round for _, s in pts if s.acc], "--", color=colour,
                   label=f"(1 - a^(k+1)) / (1 - a), measured a, {sampling}")
    left.set_xlabel("fixed k")
    left.set_ylabel("acceptance")
    left.set_ylim(0, 1.05)
    left.set_title("Per-position acceptance a vs k (model drafter)")
    right.set_xlabel("fixed k")
    right.set_ylabel("tokens per verify round (La + 1)")
    right.set_title("Tokens per round: measured vs theory")
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(fig, out / FILES["k"])


def sessions_series(an: Analysis, mode: str) -> list[tuple[int, CaseSummary]]:
    out = [(s.case.sessions, s) for s in an.summaries.values()
           if s.case.part == "concurrency" and s.case.mode == mode]
    return sorted(out, key=lambda x: x[0])


def plot_throughput_vs_sessions(an: Analysis, out: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    for mode, colour, name in (("cloud_only", "C3", "cloud_only"), ("speculative", "C0", "spec-model")):
        pts = sessions_series(an, mode)
        if not pts:
            continue
        xs = [n for n, _ in pts]
        per_cpu = [s.tokens_per_cloud_cpu_s for _, s in pts]
        wall = [s.throughput for _, s in pts]
        left.errorbar(xs, [s.mid for s in per_cpu], yerr=_err(per_cpu), marker="o", capsize=3, color=colour,
                      label=name)
        right.errorbar(xs, [s.mid for s in wall], yerr=_err(wall), marker="o", capsize=3, color=colour, label=name)
    left.set_title("Tokens per cloud CPU-second")
    right.set_title("Aggregate tokens/s (wall clock)")
    ticks = sorted({n for mode in ("cloud_only", "speculative") for n, _ in sessions_series(an, mode)})
    for ax in (left, right):
        ax.set_xlabel("concurrent edge sessions (greedy)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    left.set_ylabel("generated tokens / cloud CPU-s")
    right.set_ylabel("generated tokens / s")
    return _save(fig, out / FILES["sessions"])


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def write_all(an: Analysis, out: Path) -> dict[str, Path]:
    return {"rtt": plot_speedup_vs_rtt(an, out), "hist": plot_accepted_hist(an, out),
            "k": plot_acceptance_vs_k(an, out), "sessions": plot_throughput_vs_sessions(an, out)}
