"""What `specsplit-edge generate` prints: the text as tokens are committed, coloured by origin on a terminal, a
summary table of the run, one JSON line per round (--log), and the comparison with the cloud decoding alone
(--against-cloud-only).

Colours by origin: green an accepted draft token, yellow a correction, cyan a bonus, magenta a residual draw,
red a token committed locally, unverified.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, TextIO

import httpx

from .client import EdgeClient, GenerationResult
from .metrics import CommittedToken
from .settings import EdgeSettings
from .verdict import Run, cloud_cpu_seconds, verdict, verify_steps

COLOURS = {"accepted": "\x1b[32m", "correction": "\x1b[33m", "bonus": "\x1b[36m", "residual": "\x1b[35m",
           "local": "\x1b[31m", "target": ""}
RESET = "\x1b[0m"
# a round's fields in the --log file, one JSON object per line
LOG_FIELDS = ("index", "k", "accepted_len", "la_over_k", "alpha_mean", "edge_time_ms", "cloud_prefill_ms", "rtt_ms",
              "A_cum", "bytes_up", "bytes_down", "hard_ratio", "triggered", "next_kind", "decided_by", "committed",
              "ahead", "ahead_used", "ahead_saved_ms")


class LiveText:
    """Writes decoded text as tokens arrive; colours each token's text by origin on a terminal."""

    def __init__(self, client: EdgeClient, out: TextIO, colour: bool) -> None:
        self.client, self.out, self.colour = client, out, colour
        # special tokens (an answer's end-of-turn, e.g. <|im_end|>) end the text; they are not printed
        self.hidden = {int(i) for i in getattr(getattr(client, "tokenizer", None), "all_special_ids", None) or []}
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token_id: int, origin: str) -> None:
        if token_id in self.hidden:
            return
        self.ids.append(token_id)
        text = self.client.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        new, self.shown = text[len(self.shown):], text
        if self.colour and COLOURS.get(origin):
            new = f"{COLOURS[origin]}{new}{RESET}"
        self.out.write(new)
        self.out.flush()

    def follow(self, tokens: Iterable[CommittedToken]) -> None:
        """Every token as it is committed, then a newline."""
        for tok in tokens:
            self.add(tok.token_id, tok.origin)
        self.out.write("\n")


def summary_table(result: GenerationResult) -> str:
    m = result.metrics
    rows = [("mode", result.mode), ("tokens emitted", m.emitted), ("rounds", m.rounds),
            ("cloud calls", m.cloud_calls), ("drafted / accepted", f"{m.drafted} / {m.accepted}"),
            ("acceptance rate", f"{m.acceptance_rate:.3f}"), ("mean accepted length", f"{m.mean_accepted_len:.2f}"),
            ("tree rounds, nodes sent", f"{m.tree_rounds}, {m.tree_nodes}"),
            ("copy-branch nodes sent / accepted", f"{m.copy_nodes} / {m.copy_accepted}"),
            ("tokens per cloud call (a stream's token a call)", f"{m.tokens_per_call:.2f}"),
            ("tokens per verify call (streamed apart)", f"{m.tokens_per_verify:.2f}"),
            ("target forwards, rows per committed token", f"{m.target_forwards}, {m.rows_per_token:.2f}"),
            ("decode tokens/s (after the first)", f"{m.decode_tokens_per_s:.2f}"),
            ("session began", f"{m.start_way} ({m.start_reason}): {m.start_note}" if m.start_way else "-"),
            ("tokens speculated / streamed, switches", f"{m.emitted - m.streamed} / {m.streamed}, {m.switches}"),
            ("by origin", ", ".join(f"{k}={v}" for k, v in m.by_origin.items() if v)),
            ("local commits (unverified)", m.local_commits),
            ("of those after a missed deadline", m.timeout_fallbacks),
            ("retries / reopens / resyncs / timeouts", f"{m.retries} / {m.reopens} / {m.resyncs} / {m.timeouts}"),
            ("reopens under other numerics", m.numerics_changes),
            ("bytes up / down (of which opens')", f"{m.bytes_up} / {m.bytes_down} ({m.open_bytes_down})"),
            ("feature-fed rounds / fallback rounds, state bytes per round / at opens",
             f"{m.head_rounds} / {m.fallback_rounds}, {m.feature_bytes_per_round:.0f} / {m.open_feature_bytes}"),
            ("edge / rtt / cloud prefill ms", f"{m.edge_time_ms:.0f} / {m.rtt_ms:.0f} / {m.cloud_prefill_ms:.0f}"),
            ("drafted ahead: guess held / tried, tokens, ms saved / waited",
             f"{m.ahead_hits} / {m.ahead_rounds}, {m.ahead_tokens}, {m.ahead_saved_ms:.0f} / {m.ahead_wait_ms:.0f}"),
            ("ttft / wall ms", f"{m.ttft_ms:.0f} / {m.wall_ms:.0f}")]
    width = max(len(str(k)) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_log(path: str, result: GenerationResult) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in result.rounds:
            d = r.to_dict()
            f.write(json.dumps({k: d[k] for k in LOG_FIELDS}) + "\n")


def cloud_http(settings: EdgeSettings) -> tuple[str, dict[str, str], Any]:
    """The cloud's REST URL, headers and TLS verification, for its /metrics and /v1/model."""
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return settings.cloud_url, {"authorization": f"Bearer {key}"} if key else {}, settings.ca_cert or True


def against_cloud_only(settings: EdgeSettings, prompt: str | list[int], result: GenerationResult,
                       cpu0: float | None = None) -> str:
    """The same prompt in cloud_only mode (the cloud's own decoding), the two decode rates, and what speculation
    buys on this machine (edge/verdict.py: the cloud's CPU-seconds a token of each run, its verify cost).
    `prompt` is the run's text or ids (a chat prompt's ids: both modes tokenize with settings.tokenizer_dir())."""
    url, headers, verify = cloud_http(settings)
    cpu1 = cloud_cpu_seconds(url, headers, verify)
    client = EdgeClient(settings.model_copy(update={"mode": "cloud_only"}))
    try:
        alone = client.generate(prompt)
    finally:
        client.close()
    cpu2 = cloud_cpu_seconds(url, headers, verify)
    spec = result.metrics.decode_tokens_per_s
    base = alone.metrics.decode_tokens_per_s
    same = "the same text" if list(alone.token_ids) == list(result.token_ids) else "another text"
    line = (f"decode: {spec:.2f} tokens/s speculating against {base:.2f} tokens/s for the cloud alone "
            f"({spec / base if base else 0:.2f}x; {same})")
    try:
        info = httpx.get(url.rstrip("/") + "/v1/model", headers=headers, timeout=10, verify=verify).json()
    except (httpx.HTTPError, ValueError):
        info = {}
    m = result.metrics
    k = max(1, round(m.drafted / m.verify_calls)) if m.verify_calls else 1
    runs = [Run(spec, len(result.token_ids), cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None),
            Run(base, len(alone.token_ids), cpu2 - cpu1 if cpu1 is not None and cpu2 is not None else None)]
    said = verdict(runs[0], runs[1], k, verify_steps(info.get("forward_cost"), k),
                   "cpu" if str(info.get("device", "cpu")).startswith("cpu") else str(info.get("device")))
    return f"{line}\n{said}"
