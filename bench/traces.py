"""Recorded verify traffic of real edges, replayed by the capacity load generator (bench.loadgen).

A trace is one greedy speculative generation as the edge ran it: the prompt, then every verify
request it sent (ctx_len, ctx_hash, append_ids, draft tokens, q, draft kind) with the answer it
got. Greedy verification is deterministic, so replaying the same requests in order against a
fresh session of the same target gives the same answers; an answer that differs means the cloud
changed a session's result (for example by batching it with others) and is counted as such.

Recording runs the edge's own client (`edge.client.EdgeClient`, REST transport, the edge's dynamic
k) once per (drafter, prompt) against a `specsplit-cloud` it starts; the files under bench/traces/
were made by

    .venv/bin/python -m bench.traces

Each file also names the target it was recorded against (a hash of its weights) and the cloud's
device kind and dtype, so a trace is only replayed against that target on that kind of device in
that dtype (bench.capacity records fresh ones otherwise, e.g. for a GPU run in bfloat16).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.plan import SAMPLINGS

log = logging.getLogger("bench.traces")

TRACES_DIR = Path(__file__).resolve().parent / "traces"
# drafters a trace set is recorded with: the draft model and the n-gram drafter (NASD)
DRAFTERS = ("model", "ngram")
# version of the file layout below
TRACE_FORMAT = 1
# seed of prompt i, as in the rest of the benchmark
SEED_BASE = 1000


@dataclass
class TraceRound:
    # the request as the edge sent it (ctx_id left out: a replay opens its own session)
    ctx_len: int
    ctx_hash: str
    append_ids: list[int]
    draft_tokens: list[int]
    q_token_probs: list[float]
    # "sampled" | "deterministic"
    draft_kind: str
    # > 0 for the n-gram drafter's filler (the target's top ids per checked position)
    return_top_k: int
    # the answer the cloud gave: La, the next token, its kind, the committed context after the round
    accepted_len: int
    correction: int | None
    next_kind: str
    answer_ctx_len: int
    answer_ctx_hash: str
    # a token tree round: each node's parent (PROTOCOL.md, "Token trees"); None for a chain
    tree_parents: list[int] | None = None

    @property
    def tokens(self) -> int:
        """Tokens this round commits: the accepted drafts plus the correction or bonus."""
        return self.accepted_len + 1


@dataclass
class Trace:
    # "code/copy.py" etc. (bench/prompts), and which drafter made the drafts
    prompt: str
    drafter: str
    seed: int
    # the session's prompt and the whole generated text (target greedy)
    prompt_ids: list[int]
    token_ids: list[int]
    rounds: list[TraceRound] = field(default_factory=list)
    # the session asked for the target's feature ("" none, "float16", "int8"): a replay asks alike
    feature_encoding: str = ""

    def rounds_for(self, max_tokens: int) -> list[TraceRound]:
        """The rounds up to the first one that brings the text to `max_tokens` tokens (or all)."""
        out: list[TraceRound] = []
        done = 0
        for r in self.rounds:
            if done >= max_tokens:
                break
            out.append(r)
            done += r.tokens
        return out

    def tokens_for(self, max_tokens: int) -> int:
        """Tokens committed by `rounds_for(max_tokens)`: the length both modes generate for this text."""
        return min(sum(r.tokens for r in self.rounds_for(max_tokens)), len(self.token_ids))


@dataclass
class TraceSet:
    # sha256 of the target's weight files (see target_fingerprint)
    target_fingerprint: str
    # what the traces were recorded with: target / draft paths, sampling, budget, edge k control
    recorded_with: dict[str, Any]
    traces: list[Trace]

    def to_json(self) -> dict[str, Any]:
        return {"format": TRACE_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TraceSet:
        if d.get("format") != TRACE_FORMAT:
            raise ValueError(f"trace format {d.get('format')!r}, expected {TRACE_FORMAT}")
        traces = [Trace(**{**t, "rounds": [TraceRound(**r) for r in t["rounds"]]}) for t in d["traces"]]
        return cls(d["target_fingerprint"], d["recorded_with"], traces)


def target_fingerprint(model_dir: Path) -> str:
    """sha256 over the target's config and weight files: traces replay only against the same weights."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(model_dir).iterdir()
                   if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def save(ts: TraceSet, path: Path) -> Path:
    """Compact JSON, one round per line (small, and diffs stay readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in ts.to_json().items() if k != "traces"}
    lines = ["{" + json.dumps(head)[1:-1] + ', "traces": [']
    for i, t in enumerate(ts.traces):
        d = asdict(t)
        rounds = d.pop("rounds")
        lines.append(json.dumps(d)[:-1] + ', "rounds": [')
        lines += [json.dumps(r, separators=(",", ":")) + ("," if j < len(rounds) - 1 else "")
                  for j, r in enumerate(rounds)]
        lines.append("]}" + ("," if i < len(ts.traces) - 1 else ""))
    lines.append("]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def load(path: Path) -> TraceSet:
    return TraceSet.from_json(json.loads(Path(path).read_text()))


def load_dir(traces_dir: Path, target: Path, device: str = "cpu", dtype: str = "float32") -> list[Trace] | None:
    """Every drafter's traces in `traces_dir` recorded against `target` on a cloud of this device kind
    and dtype, interleaved by prompt (model, ngram, model, ngram, ...); None when a file is missing or
    was recorded otherwise (another dtype or device can change a greedy answer)."""
    sets = []
    fp = target_fingerprint(target)
    kind = "cpu" if device == "cpu" else "cuda"
    for drafter in DRAFTERS:
        path = Path(traces_dir) / f"{drafter}.json"
        if not path.is_file():
            return None
        ts = load(path)
        if ts.target_fingerprint != fp:
            log.info("%s was recorded against target %s, not %s", path, ts.target_fingerprint, fp)
            return None
        if (ts.recorded_with.get("device"), ts.recorded_with.get("dtype")) != (kind, dtype):
            log.info("%s was recorded on %s / %s, not %s / %s", path, ts.recorded_with.get("device"),
                     ts.recorded_with.get("dtype"), kind, dtype)
            return None
        sets.append(ts.traces)
    return [t for group in zip(*sets, strict=True) for t in group]


# -- recording ------------------------------------------------------------------------------------


class RecordingTransport:
    """Wraps the edge's REST transport and keeps every verify request with its answer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.traffic = inner.traffic
        self.supports_generate = inner.supports_generate
        self.rounds: list[TraceRound] = []

    def verify(self, req: Any, timeout: float, sampling: Any = None) -> Any:
        resp = self.inner.verify(req, timeout, sampling)
        d = req.draft
        self.rounds.append(TraceRound(
            ctx_len=req.ctx_len, ctx_hash=req.ctx_hash, append_ids=list(req.append_ids),
            draft_tokens=list(d.draft_tokens), q_token_probs=[float(q) for q in d.q_token_probs],
            draft_kind=d.draft_kind, return_top_k=req.return_top_k, accepted_len=resp.accepted_len,
            correction=resp.correction, next_kind=resp.next_kind, answer_ctx_len=resp.ctx_len,
            answer_ctx_hash=resp.ctx_hash, tree_parents=None if d.tree_parents is None else list(d.tree_parents)))
        return resp

    def routed(self, route_key: str, request_id: str | None = None) -> RecordingTransport:
        """A view sending the generation's routing key (and request id) that still records into `rounds`."""
        view = RecordingTransport(self.inner.routed(route_key, request_id))
        view.rounds = self.rounds
        return view

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def record(target: Path, draft: Path, prompts: list[tuple[str, list[int]]], max_new_tokens: int,
           cloud_url: str, device: str = "cpu", dtype: str = "float32") -> dict[str, TraceSet]:
    """One greedy speculative generation per (drafter, prompt) against the running cloud at `cloud_url`
    (which runs the target on `device` in `dtype`)."""
    from edge.client import EdgeClient
    from edge.drafters import ModelDrafter, NGramDrafter
    from edge.settings import EdgeSettings
    from edge.transport import RestTransport
    from shared.config import SamplingConfig

    sampling = SAMPLINGS["greedy"]
    fp = target_fingerprint(target)
    out: dict[str, TraceSet] = {}
    for drafter_name in DRAFTERS:
        drafter = NGramDrafter() if drafter_name == "ngram" else ModelDrafter(str(draft))
        transport = RecordingTransport(RestTransport(cloud_url))
        settings = EdgeSettings(cloud_url=cloud_url, draft="ngram" if drafter_name == "ngram" else str(draft),
                                tokenizer=str(target), mode="speculative", max_new_tokens=max_new_tokens,
                                temperature=float(sampling["temperature"]), top_p=float(sampling["top_p"]),
                                top_k=int(sampling["top_k"]),
                                repetition_penalty=float(sampling["repetition_penalty"]),
                                # every round verified: no late answer replaced by a local commit
                                timeout_ms=120_000.0)
        client = EdgeClient(settings, transport=transport, drafter=drafter)  # type: ignore[arg-type]
        traces = []
        for i, (name, ids) in enumerate(prompts):
            transport.rounds = []
            res = client.generate(ids, max_new_tokens=max_new_tokens, seed=SEED_BASE + i,
                                  sampling=SamplingConfig.from_dict(sampling), mode="speculative")
            traces.append(Trace(name, drafter_name, SEED_BASE + i, list(ids), list(res.token_ids), transport.rounds))
            log.info("recorded %s / %s: %d tokens in %d rounds", drafter_name, name, len(res.token_ids),
                     len(transport.rounds))
        client.close()
        out[drafter_name] = TraceSet(fp, {"target": _rel(target), "draft": _rel(draft) if drafter_name == "model"
                                          else "ngram", "sampling": sampling, "max_new_tokens": max_new_tokens,
                                          "k": "edge default (dynamic)", "transport": "rest",
                                          "device": "cpu" if device == "cpu" else "cuda", "dtype": dtype}, traces)
    return out


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def bench_prompts(target: Path, per_set: int, max_new_tokens: int) -> list[tuple[str, list[int]]]:
    """The first `per_set` prompts of bench/prompts/{code,prose}.jsonl, tokenized and cut to fit the
    target's context with room for `max_new_tokens` and the largest draft block."""
    from bench.runner import load_prompts, tokenize_prompts

    config = json.loads((Path(target) / "config.json").read_text())
    n_ctx = int(config.get("n_positions") or config.get("max_position_embeddings") or 1024)
    keep = n_ctx - max_new_tokens - 16 - 2
    return [(p.name, p.ids) for p in tokenize_prompts(Path(target), load_prompts(per_set), keep)]


def record_dir(target: Path, draft: Path, out_dir: Path, per_set: int, max_new_tokens: int,
               cloud_url: str | None = None, device: str = "cpu", dtype: str = "float32") -> list[Path]:
    """Record every drafter's traces against the cloud at `cloud_url` (running on `device` in `dtype`),
    or against one started for it, and write `out_dir/<drafter>.json`."""
    prompts = bench_prompts(target, per_set, max_new_tokens)
    if cloud_url is not None:
        sets = record(target, draft, prompts, max_new_tokens, cloud_url, device, dtype)
    else:
        with CloudServer(target, device, torch_threads=1, extra_args=["--runner", "torch", "--dtype", dtype]) as cloud:
            sets = record(target, draft, prompts, max_new_tokens, cloud.url, device, dtype)
    return [save(ts, Path(out_dir) / f"{name}.json") for name, ts in sets.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.traces", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=REPO / "models" / "demo-target")
    p.add_argument("--draft", type=Path, default=REPO / "models" / "demo-draft")
    p.add_argument("--out", type=Path, default=TRACES_DIR)
    p.add_argument("--prompts-per-set", type=int, default=2, help="prompts of each set (code, prose)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu", help="the cloud's torch device (traces replay only on this kind)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for path in record_dir(args.target, args.draft, args.out, args.prompts_per_set, args.max_new_tokens,
                           device=args.device, dtype=args.dtype):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
