"""specsplit-edge: generate text on the device, verified by the cloud.

`generate PROMPT` streams the text to stdout as tokens are committed (coloured by origin on a terminal), then a
summary table to stderr (edge/report.py); `serve` is an OpenAI-compatible server (docs/OPENAI.md). Every
EdgeSettings field with a description is a flag, which overrides its SPECSPLIT_EDGE_* variable and its default;
each command's `--help` lists them (serve takes sampling per request, generate has no server settings).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from shared.errors import SpecSplitError
from shared.logs import setup_logging

from .draft_choice import cloud_draft_or_later, with_cloud_draft
from .settings import EdgeSettings

# settings a server takes per request instead (OpenAI's fields, at OpenAI's values when a request leaves them out)
PER_REQUEST = frozenset({"temperature", "top_p", "top_k", "repetition_penalty", "seed"})
# a server's own settings: its clients' keys, its request bodies, its generations at once
SERVE_ONLY = frozenset({"server_api_keys", "max_body_bytes", "max_generations"})
# the EdgeSettings fields that are flags: those with a description (the rest are set by environment alone)
FLAG_FIELDS = tuple(name for name, field in EdgeSettings.model_fields.items() if field.description)


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def flag_of(name: str) -> str:
    """A setting's flag: json_schema_extra's "flag" (--k for fixed_k), else its name with dashes."""
    return "--" + str(_extra(EdgeSettings.model_fields[name]).get("flag", name.replace("_", "-")))


def add_settings_flags(p: argparse.ArgumentParser, names: list[str]) -> None:
    """One flag per field; help = its description, its default and its variable; booleans as --x / --no-x.
    A flag left out stays None, so that SPECSPLIT_EDGE_* or the default applies (settings_from_args)."""
    group = p.add_argument_group("settings (a flag overrides its SPECSPLIT_EDGE_* variable)")
    for name in names:
        field = EdgeSettings.model_fields[name]
        flag, kind = flag_of(name), field.annotation
        if get_origin(kind) in (Union, UnionType):  # `int | None` -> int
            kind = next(a for a in get_args(kind) if a is not type(None))
        env = f"{EdgeSettings.model_config.get('env_prefix', '')}{name.upper()}"
        text = (field.description or "").replace("%", "%%")  # argparse formats help with %
        # a default the description does not restate; None or a computed one: the description says what unset does
        d = None if field.default_factory is not None else field.default
        said = "" if d is None else f"default {('on' if d else 'off') if isinstance(d, bool) else d}; "
        kw: dict[str, Any] = {"dest": name, "help": f"{text} ({said}env {env})"}
        metavar = _extra(field).get("metavar", flag[2:].upper().replace("-", "_"))
        if get_origin(kind) is list:  # repeatable
            kw.update(action="append", metavar=metavar, help=f"{text} (repeatable; env {env}, a JSON list)")
        elif kind is bool:
            kw.update(action=argparse.BooleanOptionalAction)
        elif get_origin(kind) is Literal:
            kw.update(choices=get_args(kind))
        else:  # int and float typed here; str and SecretStr stay strings, which pydantic checks and converts
            kw.update(metavar=metavar, **({"type": kind} if kind in (int, float) else {}))
        group.add_argument(flag, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specsplit-edge", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of PROMPT")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="send PROMPT as a user message through the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--log", metavar="FILE.jsonl", help="one JSON line per round")
    g.add_argument("--against-cloud-only", action="store_true",
                   help="then run the same prompt with --mode cloud_only (quietly) and print both decode rates")
    g.add_argument("--request-id", help="sent as X-Request-Id on every cloud call (the cloud logs it with the "
                   "session's ctx_id)")
    s = sub.add_parser("serve", help="an OpenAI-compatible server on this device (docs/OPENAI.md)")
    s.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default 127.0.0.1; beyond loopback it needs --server-api-key)")
    s.add_argument("--port", type=int, default=8001, help="port to listen on (default 8001)")
    s.add_argument("--served-model-name", help="the model id clients send (default: the cloud's model id)")
    for command, leave_out in ((g, SERVE_ONLY), (s, PER_REQUEST)):
        command.add_argument("--chat-template", metavar="FILE", help="Jinja chat template (default: the tokenizer's)")
        command.add_argument("-v", "--verbose", action="store_true", help="log level info (as --log-level info)")
        command.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                             help="log lines on stderr at this level and above (default warning; serve: info)")
        command.add_argument("--log-format", choices=["text", "json"], default="text",
                             help="log lines on stderr: text, or JSON lines (one object per line)")
        add_settings_flags(command, [name for name in FLAG_FIELDS if name not in leave_out])
    return p


def settings_from_args(args: argparse.Namespace) -> EdgeSettings:
    """Flags over SPECSPLIT_EDGE_* over defaults; no I/O (the draft the cloud picks: with_cloud_draft)."""
    return EdgeSettings(**{name: getattr(args, name) for name in FLAG_FIELDS
                           if getattr(args, name, None) is not None})


def generate(args: argparse.Namespace) -> int:
    from .client import EdgeClient  # here: --help loads no torch
    from .report import LiveText, against_cloud_only, cloud_http, summary_table, write_log
    from .verdict import cloud_cpu_seconds

    settings = with_cloud_draft(settings_from_args(args), args)
    _set_threads(settings)
    client = EdgeClient(settings)
    compare = args.against_cloud_only and settings.mode != "cloud_only"
    cpu0 = cloud_cpu_seconds(*cloud_http(settings)) if compare else None
    try:
        prompt = chat_prompt(client.tokenizer, args) if args.chat else args.prompt
        gen = client.stream(prompt, request_id=args.request_id)
        if not args.json:
            LiveText(client, sys.stdout, colour=sys.stdout.isatty()).follow(gen)
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
        print(against_cloud_only(settings, prompt, result, cpu0), file=sys.stderr)
    return 0


def chat_prompt(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    """PROMPT as one user message through the chat template, tokenized without added special tokens."""
    from .server.chat import ChatMessage, load_chat_template, require

    template = require(load_chat_template(args.chat_template, tokenizer))
    text = template.render([ChatMessage("user", args.prompt)])
    return list(tokenizer.encode(text, add_special_tokens=False))


def serve(args: argparse.Namespace) -> int:
    from .server.serve import ServeArgs, run
    from .server.server_auth import check_exposure

    settings = settings_from_args(args)
    check_exposure(args.host, settings.server_key_values())  # before any model load or cloud call
    settings, choose_later = cloud_draft_or_later(settings, args)
    _set_threads(settings)
    run(settings, ServeArgs(args.host, args.port, args.chat_template, args.served_model_name, choose_later),
        log_level=args.log_level or ("info" if args.verbose else "warning"))
    return 0


def _set_threads(settings: EdgeSettings) -> None:
    """The draft's threads (--threads, else SPECSPLIT_EDGE_THREADS) for PyTorch; llama.cpp's draft takes
    settings.threads when it loads."""
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)


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
