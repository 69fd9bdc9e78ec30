"""specsplit-edge: generate text on the device, verified by the cloud.

    specsplit-edge generate PROMPT --cloud http://127.0.0.1:8000 [--grpc 127.0.0.1:50051]
        --draft DIR|ngram --mode speculative|edge_only|cloud_only --max-new-tokens N
        --temperature T --top-p P --top-k K --repetition-penalty R --seed S [--route-key KEY]
        [--json] [--log FILE.jsonl] [--chat [--chat-template FILE]]
    specsplit-edge serve --cloud URL --draft DIR|ngram [--chat-template FILE] [--served-model-name NAME]
        --host 127.0.0.1 --port 8001 [--server-api-key KEY]   (an OpenAI-compatible server: docs/OPENAI.md;
        a --host beyond loopback needs --server-api-key)

Defaults (EdgeSettings, overridable by SPECSPLIT_EDGE_* variables): without --draft, the edge asks the cloud
for its tokenizer (GET /v1/model; `serve` started before its cloud asks at the cloud's first answer) and
drafts with the model under models/ that speaks it (edge/model_choice.py: the bundled drafts first,
models/qwen2.5-coder-0.5b-instruct for the coder pair's cloud, the SmolLM2 draft for SmolLM2's, then any
folder under models/ with that tokenizer); cloud_only without --tokenizer or --draft tokenizes with a folder
under models/ that holds the cloud's tokenizer, or refuses naming both flags; a draft directory holding
model.gguf, or a .gguf file, drafts on llama.cpp (edge/settings.py load_draft_model); --draft ngram drafts from the context alone. Temperature 1.0, top-p 0.9, top-k 0 (off),
repetition penalty 1.1 (generate's defaults; serve uses OpenAI's, top-p 1.0 and no penalty, as an app written
against OpenAI's API expects of a field it leaves out), seed 0, 128 new tokens, k chosen per round by the cost model, trees whenever the cloud
takes them, gating off, an adaptive verify deadline with every token verified (--timeout-fallback opts into
committing a late round's first draft token unverified), 6 retries (--max-retries), a random routing key
(X-Specsplit-Route) per run, log level warning for generate and info for serve (--log-level, -v = info).

Text streams to stdout as tokens are committed; on a terminal each token is coloured by origin
(green accepted draft, yellow correction, cyan bonus, magenta residual, red local/unverified).
A summary table follows on stderr. --json prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, TextIO

import httpx
from pydantic import ValidationError

from shared.errors import SpecSplitError
from shared.logs import setup_logging

from .client import EdgeClient, GenerationResult
from .model_choice import ask_cloud, for_cloud
from .settings import EdgeSettings
from .verdict import Run, cloud_cpu_seconds, verdict, verify_steps

COLOURS = {"accepted": "\x1b[32m", "correction": "\x1b[33m", "bonus": "\x1b[36m", "residual": "\x1b[35m",
           "local": "\x1b[31m", "target": ""}
RESET = "\x1b[0m"
LOG_FIELDS = ("index", "k", "accepted_len", "la_over_k", "alpha_mean", "edge_time_ms", "cloud_prefill_ms", "rtt_ms",
              "A_cum", "bytes_up", "bytes_down", "hard_ratio", "triggered", "next_kind", "decided_by", "committed",
              "ahead", "ahead_used", "ahead_saved_ms")

# flag -> EdgeSettings field
_FLAGS: dict[str, str] = {"cloud": "cloud_url", "grpc": "grpc_target", "api_key": "api_key", "grpc_tls": "grpc_tls",
                          "ca_cert": "ca_cert", "draft": "draft",
                          "tokenizer": "tokenizer", "mode": "mode", "max_new_tokens": "max_new_tokens",
                          "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "repetition_penalty": "repetition_penalty", "seed": "seed", "correction": "correction",
                          "send_q_dists": "send_q_dists", "k": "fixed_k", "k_start": "k_start", "k_min": "k_min",
                          "k_max": "k_max", "gating": "gating", "timeout_ms": "timeout_ms",
                          "timeout_fallback": "timeout_fallback", "deadline_floor_ms": "deadline_floor_ms",
                          "deadline_ceiling_ms": "deadline_ceiling_ms", "deadline_first_ms": "deadline_first_ms",
                          "ngram_order": "ngram_order",
                          "filler_top_k": "filler_top_k", "device": "device", "r_hard": "r_hard",
                          "hybrid": "hybrid", "route_key": "route_key", "k_policy": "k_policy",
                          "draft_ahead": "draft_ahead", "max_body_bytes": "max_body_bytes", "head": "head",
                          "feature_encoding": "feature_encoding", "open_states": "open_states", "check_last": "check_last", "tree": "tree",
                          "tree_width": "tree_width", "tree_depth": "tree_depth", "tree_max_nodes": "tree_max_nodes",
                          "tree_copy": "tree_copy",
                          "stream_switch": "stream_switch", "objective": "objective", "node_budget": "node_budget", "draft_dtype": "draft_dtype",
                          "draft_runtime": "draft_runtime", "threads": "threads",
                          "capacity_wait_s": "capacity_wait_s", "max_retries": "max_retries",
                          "server_api_keys": "server_api_keys",
                          "max_generations": "max_generations"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specsplit-edge", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of PROMPT")
    g.add_argument("prompt")
    g.add_argument("--cloud", help="cloud REST base URL (default http://127.0.0.1:8000)")
    g.add_argument("--grpc", help="cloud gRPC HOST:PORT (verification over gRPC instead of REST)")
    g.add_argument("--api-key", help="Bearer key for the cloud")
    g.add_argument("--grpc-tls", action=argparse.BooleanOptionalAction, default=None,
                   help="gRPC over TLS (a TLS Ingress or nginx in front of the cloud; default off); REST takes TLS "
                        "from an https:// --cloud URL")
    g.add_argument("--ca-cert", metavar="PEM", help="the CA certificate that signed the cloud's TLS certificate (a "
                                                    "private CA; default: the system's trust store); TLS only: "
                                                    "with an https:// --cloud URL, or --grpc with --grpc-tls "
                                                    "(refused otherwise)")
    g.add_argument("--route-key", help="routing key sent as X-Specsplit-Route (default: a random one per run); "
                                       "a load balancer hashing on it keeps the session on one replica")
    g.add_argument("--draft", help="tokens-only draft: a .gguf file or a directory holding model.gguf (run by "
                                   "llama.cpp), a Hugging Face model directory (PyTorch), or 'ngram' (default: the "
                                   "draft under models/ that speaks the tokenizer the cloud names at first contact)")
    g.add_argument("--head", help="draft head directory fed the target's states, or 'none' (default: "
                                  "models/smollm2-135m-attention-head when present, else none; "
                                  "models/smollm2-135m-head the one-state head); used whenever the cloud offers "
                                  "features that match it (hidden size and tokenizer), --draft otherwise")
    g.add_argument("--feature-encoding", choices=["auto", "float16", "int8"],
                   help="how the cloud sends the target's states (default auto: int8, 580 bytes a state for "
                        "SmolLM2, when the cloud offers it, else float16, 1,152)")
    g.add_argument("--open-states", type=int,
                   help="with a head that attends over past states: the prompt's last N states an open asks for "
                        "(default 16, at most the head's window; 580 bytes each in int8)")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the draft's; with --draft ngram, "
                                       "models/smollm2-135m-draft-from-target, SmolLM2-135M-Instruct's tokenizer)")
    g.add_argument("--mode", choices=["speculative", "edge_only", "cloud_only"])
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, help=f"default {_setting_default('top_p')} ({_WHY_NOT_SERVES})")
    g.add_argument("--top-k", type=int, help="default 0 (off)")
    g.add_argument("--repetition-penalty", type=float,
                   help=f"default {_setting_default('repetition_penalty')} ({_WHY_NOT_SERVES})")
    g.add_argument("--seed", type=int)
    g.add_argument("--correction", choices=["strict", "shortcut"])
    g.add_argument("--send-q-dists", action=argparse.BooleanOptionalAction, default=None,
                   help="send the draft's sparse q distributions")
    g.add_argument("--k", type=int, help="fixed k: a chain of k drafts every round (default: chosen per round by "
                                         "--k-policy; trees when the cloud takes them)")
    g.add_argument("--tree", help="token trees: auto (default: whenever the cloud takes them and --k is not given; "
                                  "nodes chosen per round), off (chains), or a fixed node count")
    g.add_argument("--tree-width", type=int, help="children per expanded node and nodes expanded per level "
                                                  "(default 4)")
    g.add_argument("--tree-depth", type=int, help="levels of the first tree (default 6; then adapted)")
    g.add_argument("--tree-max-nodes", type=int, help="most nodes a tree sends (default 32)")
    g.add_argument("--tree-copy", action=argparse.BooleanOptionalAction, default=None,
                   help="graft into every tree what followed the context's last tokens earlier in it (copy "
                        "branches; default on)")
    g.add_argument("--stream-switch", action=argparse.BooleanOptionalAction, default=None,
                   help="let the cloud stream target-only tokens on the session whenever that is cheaper than "
                        "speculating, and speculate again when that pays (greedy and tree sessions; default on)")
    g.add_argument("--node-budget", action=argparse.BooleanOptionalAction, default=None,
                   help="send at most the node budget of the cloud's last answer, the draft nodes the cloud wants "
                        "per round for its load, and value a new session's nodes by the key's pooled acceptance "
                        "the open answer gives (default on; off: rounds sized for the edge's latency and its own "
                        "evidence alone)")
    g.add_argument("--objective", choices=["latency", "cloud"],
                   help="what the switch minimises: latency (default: the edge's time per token) or cloud "
                        "(the cloud's forward time per token)")
    g.add_argument("--check-last", action=argparse.BooleanOptionalAction, default=None,
                   help="sampled sessions: one more draft token checked by the cloud in place of a bonus, so a "
                        "seed gives one text whatever the rounds (default on)")
    g.add_argument("--k-policy", choices=["cost", "dynamic"],
                   help="cost: the k with the most tokens per second from measured costs (default); "
                        "dynamic: +1 / -1 on the last round's la/k")
    g.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="draft the next block while the cloud verifies (model drafter; default on)")
    g.add_argument("--k-start", type=int)
    g.add_argument("--k-min", type=int)
    g.add_argument("--k-max", type=int)
    g.add_argument("--gating", action=argparse.BooleanOptionalAction, default=None, help="uncertainty gating")
    g.add_argument("--r-hard", type=float)
    g.add_argument("--timeout-ms", type=float, help="a fixed verify deadline (default: adaptive, see "
                                                     "--deadline-*)")
    g.add_argument("--deadline-first-ms", type=float, help="the adaptive deadline before any round (default 10000)")
    g.add_argument("--deadline-floor-ms", type=float, help="lowest adaptive deadline (default 500)")
    g.add_argument("--deadline-ceiling-ms", type=float, help="highest adaptive deadline (default 30000)")
    g.add_argument("--timeout-fallback", action=argparse.BooleanOptionalAction, default=None,
                   help="lossy: on a missed deadline commit the first draft token unverified (default off)")
    g.add_argument("--ngram-order", type=int)
    g.add_argument("--filler-top-k", type=int)
    g.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=None,
                   help="n-gram continuation while confident, the draft model for the rest")
    g.add_argument("--device")
    g.add_argument("--max-retries", type=int,
                   help="resends of a call after 429 / 413 / 5xx / a missed deadline / a connection error, with "
                        "exponential backoff (default 6)")
    g.add_argument("--capacity-wait-s", type=float,
                   help="past its retries, keep waiting out the cloud's 429 capacity answers this long (default 300)")
    g.add_argument("--draft-dtype", choices=["auto", "float32", "bfloat16"],
                   help="dtype of the draft model (default auto: bfloat16 where the CPU has bfloat16 units, else float32)")
    g.add_argument("--draft-runtime", choices=["auto", "llamacpp", "torch"],
                   help="what runs the draft: llama.cpp on a GGUF (a .gguf file or a directory with model.gguf), "
                        "PyTorch on a Hugging Face directory, or auto (default: llama.cpp where the draft has a GGUF "
                        "and llama-cpp-python is installed)")
    g.add_argument("--threads", type=int, help="threads of the draft model (default: torch's own count in PyTorch, "
                                               "half the cores, 1 to 4, in llama.cpp)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--against-cloud-only", action="store_true",
                   help="then run the same prompt with --mode cloud_only (quietly) and print both decode rates")
    g.add_argument("--log", metavar="FILE.jsonl", help="one JSON line per round")
    g.add_argument("-v", "--verbose", action="store_true", help="log level info (as --log-level info)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="log lines on stderr at this level and above (default warning; serve: info)")
    g.add_argument("--request-id", help="sent as X-Request-Id on every cloud call (the cloud logs it with the "
                   "session's ctx_id)")
    g.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="log lines on stderr: text, or JSON lines (one object per line)")
    g.add_argument("--chat", action="store_true", help="send PROMPT as a user message through the chat template")
    g.add_argument("--chat-template", metavar="FILE", help="Jinja chat template (default: the tokenizer's)")
    add_serve_parser(sub, g)
    return p


# generate's options that a server takes per request instead (OpenAI fields, OpenAI defaults)
# why serve's sampling defaults are not generate's (--help says it beside each default that differs)
_WHY_NOT_SERVES = ("serve's requests default to OpenAI's 1.0, as an app that leaves the field out expects; "
                   "generate keeps the engineering guide's, edge/settings.py")


def _setting_default(name: str) -> Any:
    """EdgeSettings' default for a field (what generate uses when the flag and SPECSPLIT_EDGE_* are unset)."""
    return EdgeSettings.model_fields[name].default


_PER_REQUEST = {"prompt", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "json", "log", "chat",
                "help", "request_id"}


def add_serve_parser(sub: Any, generate: argparse.ArgumentParser) -> None:
    """`serve` takes generate's edge options (cloud, draft, k, gating, timeouts, ...) and its own."""
    s = sub.add_parser("serve", help="an OpenAI-compatible server on this device (docs/OPENAI.md)")
    for action in generate._actions:
        if action.dest not in _PER_REQUEST:
            s._add_action(action)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8001)
    s.add_argument("--server-api-key", dest="server_api_keys", action="append", metavar="KEY",
                   help="a Bearer key this server accepts on every /v1 route, repeatable (env "
                        "SPECSPLIT_EDGE_SERVER_API_KEYS, a JSON list); required unless --host is loopback")
    s.add_argument("--served-model-name", help="the model id clients send (default: the cloud's model id)")
    s.add_argument("--max-body-bytes", type=int, help="largest request body; larger answer 413 (default 4 MiB)")
    s.add_argument("--max-generations", type=int, metavar="N",
                   help="generations run at once (default 8); one more answers 429 rate_limit_error, code "
                        "server_busy, with Retry-After: each holds its own draft state (llama.cpp: a context of "
                        "8,192 KV cells and 128 logit rows)")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EdgeSettings fields the flags given set (the rest come from SPECSPLIT_EDGE_* or defaults)."""
    return {name: getattr(args, flag) for flag, name in _FLAGS.items() if getattr(args, flag, None) is not None}


def settings_from_args(args: argparse.Namespace) -> EdgeSettings:
    """Flags over SPECSPLIT_EDGE_* over defaults; no I/O (the draft the cloud picks: with_cloud_draft)."""
    return EdgeSettings(**overrides_from_args(args))


def draft_given(args: argparse.Namespace) -> bool:
    """--draft or SPECSPLIT_EDGE_DRAFT names the draft: the cloud does not choose it."""
    return getattr(args, "draft", None) is not None or "SPECSPLIT_EDGE_DRAFT" in os.environ


def cloud_chooses(settings: EdgeSettings, args: argparse.Namespace) -> bool:
    """Whether the cloud's tokenizer picks the model: no --draft, and in cloud_only mode no --tokenizer either
    (there the draft names only the tokenizer)."""
    if draft_given(args):
        return False
    return settings.mode != "cloud_only" or (getattr(args, "tokenizer", None) is None
                                             and "SPECSPLIT_EDGE_TOKENIZER" not in os.environ)


def with_cloud_draft(settings: EdgeSettings, args: argparse.Namespace) -> EdgeSettings:
    """The settings with the draft (cloud_only: the tokenizer) that speaks the cloud's tokenizer, unless one was
    given; a cloud that does not answer leaves the default, with one warning line; InvalidArgument naming
    --tokenizer / --draft when nothing under models/ speaks the tokenizer of a cloud_only cloud."""
    if not cloud_chooses(settings, args):
        return settings
    info = ask_cloud(settings)
    if info is None:
        what = "tokenizing" if settings.mode == "cloud_only" else "drafting"
        flag = "--tokenizer" if settings.mode == "cloud_only" else "--draft"
        logging.getLogger(__name__).warning("the cloud did not answer: %s with %s, which may not speak its "
                                            "tokenizer; pass %s to choose", what, settings.tokenizer_dir()
                                            if settings.mode == "cloud_only" else settings.draft, flag)
        return settings
    return for_cloud(settings, info)


def cloud_draft_or_later(settings: EdgeSettings, args: argparse.Namespace) -> tuple[EdgeSettings, bool]:
    """`serve`: as with_cloud_draft, but a cloud that does not answer yet leaves the choice to the server's first
    contact with it. True: the draft (cloud_only: the tokenizer) follows the cloud's tokenizer: chosen at that first
    contact, and again when the cloud comes back with another (edge/server/openai_engine.py)."""
    if not cloud_chooses(settings, args):
        return settings, False
    info = ask_cloud(settings)
    return (settings if info is None else for_cloud(settings, info)), True


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


def generate(args: argparse.Namespace) -> int:
    settings = with_cloud_draft(settings_from_args(args), args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    client = EdgeClient(settings)
    compare = args.against_cloud_only and settings.mode != "cloud_only"
    cpu0 = cloud_cpu_seconds(*_cloud_http(settings)) if compare else None
    try:
        gen = client.stream(chat_prompt(client, args) if args.chat else args.prompt, request_id=args.request_id)
        if not args.json:
            live = LiveText(client, sys.stdout, colour=sys.stdout.isatty())
            for tok in gen:
                live.add(tok.token_id, tok.origin)
            sys.stdout.write("\n")
        result = gen.result()
    finally:
        client.close()
    if args.log:
        write_log(args.log, result)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(summary_table(result), file=sys.stderr)
    if compare:
        print(against_cloud_only(settings, args, result, cpu0), file=sys.stderr)
    return 0


def _cloud_http(settings: EdgeSettings) -> tuple[str, dict[str, str], Any]:
    """The cloud's REST URL, headers and TLS verification, for its /metrics and /v1/model."""
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return settings.cloud_url, {"authorization": f"Bearer {key}"} if key else {}, settings.ca_cert or True


def against_cloud_only(settings: EdgeSettings, args: argparse.Namespace, result: GenerationResult,
                       cpu0: float | None = None) -> str:
    """The same prompt in cloud_only mode (the cloud's own decoding), the two decode rates, and what speculation
    buys on this machine (edge/verdict.py: the cloud's CPU-seconds a token of each run, its verify cost)."""
    url, headers, verify = _cloud_http(settings)
    cpu1 = cloud_cpu_seconds(url, headers, verify)
    client = EdgeClient(settings.model_copy(update={"mode": "cloud_only"}))
    try:
        alone = client.generate(chat_prompt(client, args) if args.chat else args.prompt)
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


def chat_prompt(client: EdgeClient, args: argparse.Namespace) -> list[int]:
    """PROMPT as one user message through the chat template, tokenized without added special tokens."""
    from .server.chat import ChatMessage, load_chat_template, require

    template = require(load_chat_template(args.chat_template, client.tokenizer))
    text = template.render([ChatMessage("user", args.prompt)])
    return list(client.tokenizer.encode(text, add_special_tokens=False))


def serve(args: argparse.Namespace) -> int:
    from .server.serve import ServeArgs, run
    from .server.server_auth import check_exposure

    settings = settings_from_args(args)
    check_exposure(args.host, settings.server_key_values())  # before any model load or cloud call
    settings, choose_later = cloud_draft_or_later(settings, args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    run(settings, ServeArgs(args.host, args.port, args.chat_template, args.served_model_name, choose_later),
        log_level=args.log_level or ("info" if args.verbose else "warning"))
    return 0


def log_level(args: argparse.Namespace) -> str:
    """--log-level; else info with -v or for a server (a line per request), warning for a one-off generation."""
    if args.log_level:
        return str(args.log_level)
    return "info" if args.verbose or args.command == "serve" else "warning"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(log_level(args), args.log_format)
    # httpx writes a line per cloud call at INFO, transformers a bar per model load: shown only when asked for
    if not args.verbose and args.log_level not in ("debug", "info"):
        logging.getLogger("httpx").setLevel(logging.WARNING)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return serve(args) if args.command == "serve" else generate(args)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'settings'}: {err['msg']}"
                             for err in e.errors())
        print(f"specsplit-edge: bad settings: {problems}", file=sys.stderr)
        return 2
    except SpecSplitError as e:
        extra = f" [error_id {e.details['error_id']}]" if "error_id" in e.details else ""
        print(f"specsplit-edge: {e.code} ({e.http_status}): {e.message}{extra}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # a missing / malformed / unsupported model, tokenizer or template file
        print(f"specsplit-edge: cannot start: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
