"""What the benchmark runs: the cases of each part, for the full run and for `--quick`.

Parts:
- main: every mode at loopback, one session, the fixed prompt set, repeated for noise.
- rtt: a subset of modes through the delay proxy at each injected round-trip time.
- k: fixed k swept for the model drafter (acceptance vs k), one run each.
- concurrency: speculative (model drafter) vs cloud_only, greedy, 1..16 sessions against the one cloud.
- net (`specsplit-bench --only network`): both drafters, greedy and sampled, at 0 / 10 / 50 / 100 ms
  round trip: the dynamic k, a fixed-k sweep, the cost-model k with and without drafting ahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

Mode = Literal["speculative", "edge_only", "cloud_only"]
Part = Literal["main", "rtt", "k", "concurrency", "net"]

# the two sampling settings measured (repetition penalty 1.1 is the edge's default, on both sides)
SAMPLINGS: dict[str, dict[str, float | int]] = {
    "greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.1},
    "sampled": {"temperature": 1.0, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.1},
}


@dataclass(frozen=True)
class Case:
    # which part of the report it belongs to
    part: Part
    # speculative | edge_only | cloud_only
    mode: Mode
    # "model" (the draft model), "ngram", or None (cloud_only)
    drafter: str | None
    # key of SAMPLINGS
    sampling: str
    # fixed k, or None for the edge's dynamic k
    fixed_k: int | None = None
    # injected round-trip time through the delay proxy, ms (0 = direct loopback, no proxy)
    rtt_ms: float = 0.0
    # edge clients running at once against the one cloud
    sessions: int = 1
    # generations per session (each session walks the prompt set from its own offset)
    per_session: int = 0
    # runs of the whole case (timing noise: min-max over these)
    repeats: int = 1
    # the edge's k policy when k is not fixed ("dynamic" | "cost") and drafting while verifying
    k_policy: str = "dynamic"
    draft_ahead: bool = False

    @property
    def label(self) -> str:
        """Short name of the mode: cloud_only, edge_only, spec-model, spec-ngram, + k."""
        if self.mode != "speculative":
            return self.mode
        k = f"k={self.fixed_k}" if self.fixed_k is not None else f"{self.k_policy} k"
        ahead = ", ahead" if self.draft_ahead and self.drafter == "model" else ""
        return f"spec-{self.drafter} ({k}{ahead})"

    @property
    def key(self) -> str:
        """Unique id of the case within a run."""
        k = ("dyn" if self.k_policy == "dynamic" else self.k_policy) if self.fixed_k is None else str(self.fixed_k)
        ahead = "+ahead" if self.draft_ahead and self.mode == "speculative" else ""
        return (f"{self.part}/{self.mode}/{self.drafter or '-'}/{self.sampling}/k{k}{ahead}/rtt{self.rtt_ms:g}/"
                f"s{self.sessions}")

    def baseline_key(self) -> str:
        """The cloud_only case this one is compared with (same part, sampling, rtt, sessions)."""
        part = "main" if self.part == "k" else self.part
        return Case(part, "cloud_only", None, self.sampling, None, self.rtt_ms, self.sessions).key


@dataclass(frozen=True)
class Plan:
    # prompts per set (code, prose) taken from the start of each committed file
    prompts_per_set: int
    # new tokens per generation
    max_new_tokens: int
    cases: list[Case] = field(default_factory=list)
    # fixed k of the main table's fixed-k rows
    main_k: int = 4
    # one unmeasured short generation per session slot before a case's first repeat
    warmup: bool = True


def main_cases(repeats: int, k: int) -> list[Case]:
    out: list[Case] = []
    for sampling in SAMPLINGS:
        out.append(Case("main", "cloud_only", None, sampling, repeats=repeats))
        out.append(Case("main", "edge_only", "model", sampling, repeats=repeats))
        for drafter in ("model", "ngram"):
            for fixed_k in (k, None):
                out.append(Case("main", "speculative", drafter, sampling, fixed_k, repeats=repeats))
    return out


def rtt_cases(rtts: list[float], repeats: int, samplings: tuple[str, ...] = ("greedy", "sampled"),
              ngram: bool = True) -> list[Case]:
    out: list[Case] = []
    for rtt in rtts:
        for sampling in samplings:
            out.append(Case("rtt", "cloud_only", None, sampling, rtt_ms=rtt, repeats=repeats))
            out.append(Case("rtt", "speculative", "model", sampling, None, rtt_ms=rtt, repeats=repeats))
        if ngram:
            out.append(Case("rtt", "speculative", "ngram", "greedy", None, rtt_ms=rtt, repeats=repeats))
    return out


def net_cases(rtts: list[float], sweep: list[int], repeats: int = 1,
              samplings: tuple[str, ...] = ("greedy", "sampled"),
              drafters: tuple[str, ...] = ("model", "ngram")) -> list[Case]:
    """Per RTT and sampling: cloud_only, then per drafter the dynamic k, each fixed k of `sweep`, the
    cost-model k, and (model drafter) the cost-model k drafting while verifying."""
    out: list[Case] = []
    for rtt in rtts:
        for sampling in samplings:
            out.append(Case("net", "cloud_only", None, sampling, rtt_ms=rtt, repeats=repeats))
            for d in drafters:
                out.append(Case("net", "speculative", d, sampling, None, rtt, repeats=repeats))
                out += [Case("net", "speculative", d, sampling, k, rtt, repeats=repeats) for k in sweep]
                out.append(Case("net", "speculative", d, sampling, None, rtt, repeats=repeats, k_policy="cost"))
                if d == "model":
                    out.append(Case("net", "speculative", d, sampling, None, rtt, repeats=repeats, k_policy="cost",
                                    draft_ahead=True))
    return out


def network_plan(quick: bool = False) -> Plan:
    """The network section alone: about 15 minutes on 2 loaded cores (quick: seconds)."""
    if quick:
        return Plan(prompts_per_set=1, max_new_tokens=8, main_k=2, warmup=False,
                    cases=net_cases([20.0], [1, 2], samplings=("greedy",)))
    return Plan(prompts_per_set=1, max_new_tokens=64, main_k=4, cases=net_cases([0.0, 10.0, 50.0, 100.0],
                                                                              [1, 2, 4, 8]))


def k_cases(ks: list[int], main_k: int, samplings: tuple[str, ...] = ("greedy", "sampled")) -> list[Case]:
    return [Case("k", "speculative", "model", sampling, k) for sampling in samplings for k in ks if k != main_k]


def concurrency_cases(sessions: list[int], per_session: int, repeats: int) -> list[Case]:
    pairs: list[tuple[Mode, str | None]] = [("cloud_only", None), ("speculative", "model")]
    return [Case("concurrency", mode, drafter, "greedy", None, sessions=n, per_session=per_session, repeats=repeats)
            for n in sessions for mode, drafter in pairs]


def full_plan() -> Plan:
    """About 7 minutes on 2 cores with another job busy on one of them; the time budget (bench.run) trims
    later repeats when the machine is slower than that."""
    k = 4
    return Plan(prompts_per_set=2, max_new_tokens=64, main_k=k, cases=[
        *main_cases(repeats=3, k=k),
        *rtt_cases([10.0, 50.0], repeats=2),
        *k_cases([1, 2, 6, 8], k),
        *concurrency_cases([1, 4, 8, 16], per_session=1, repeats=2),
    ])


def quick_plan() -> Plan:
    k = 2
    return Plan(prompts_per_set=1, max_new_tokens=8, main_k=k, warmup=False, cases=[
        *main_cases(repeats=1, k=k),
        *rtt_cases([20.0], repeats=1, samplings=("greedy",), ngram=False),
        *k_cases([1, 2], k, samplings=("greedy",)),
        *concurrency_cases([1, 2], per_session=1, repeats=1),
    ])


def with_repeats(plan: Plan, repeats: int) -> Plan:
    """Every case repeated `repeats` times (the k sweep included)."""
    return replace(plan, cases=[replace(c, repeats=repeats) for c in plan.cases])
