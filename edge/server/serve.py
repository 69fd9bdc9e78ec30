"""`specsplit-edge serve`: the OpenAI-compatible server, built from EdgeSettings and run by uvicorn.

The draft model and the tokenizer load once at start-up. Start-up then checks the port, and the
cloud: a cloud that refuses the key, or a draft / tokenizer the target does not speak, stops the
start with one line naming the fix; a cloud that cannot be reached yet only warns (the server starts,
`/readyz` answers 503 until the cloud answers, and requests fail fast with 503 meanwhile). Without `--draft`,
the draft is the one that speaks the cloud's tokenizer: asked at start-up, or, when the cloud is not up yet, at
the first answer, before any request is served (openai_engine.py `_adopt`).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from dataclasses import dataclass

from fastapi import FastAPI

from ..settings import EdgeSettings
from ..transport.errors import CloudTimeout, CloudUnavailable
from .chat import load_chat_template
from .openai_api import ServeOptions, create_app
from .openai_engine import OpenAIEngine
from .shared_draft import LockedTokenizer, SharedDraftModel


@dataclass(frozen=True)
class ServeArgs:
    # interface and port to listen on
    host: str = "127.0.0.1"
    port: int = 8001
    # a Jinja chat template file; None: the tokenizer's own template, if any
    chat_template_file: str | None = None
    # the model id of /v1/models; None: the cloud's model_id
    served_model_name: str | None = None
    # no --draft: the draft follows the cloud's tokenizer (chosen at its first answer, again after a change)
    choose_draft: bool = False


log = logging.getLogger(__name__)


def build_engine(settings: EdgeSettings, choose_draft: bool = False) -> OpenAIEngine:
    from shared.tokenizer_id import load_tokenizer

    from ..client import check_tokenizer_dir

    tokenizer = load_tokenizer(check_tokenizer_dir(settings))  # one-line error when the directory has none
    return OpenAIEngine(settings, SharedDraftModel(settings), LockedTokenizer(tokenizer), choose_draft=choose_draft)


def build_app(settings: EdgeSettings, args: ServeArgs, engine: OpenAIEngine | None = None) -> FastAPI:
    engine = engine or build_engine(settings)
    template = load_chat_template(args.chat_template_file, engine.tokenizer.tokenizer)
    engine.chat_template_file = args.chat_template_file  # reloaded when the draft (and tokenizer) is chosen later
    options = ServeOptions(served_model_name=args.served_model_name, chat_template=template,
                           chat_default_max_tokens=settings.max_new_tokens)
    return create_app(engine, options)


def check_port(host: str, port: int) -> None:
    """OSError with one line when another process listens on host:port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(f"port {port} on {host} is in use: stop that process or pass --port PORT") from None
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}; check --host and --port") from None


def check_cloud(engine: OpenAIEngine) -> None:
    """Refuse to start on what will not fix itself (a refused key, a mismatched pair); only warn while
    the cloud cannot be reached."""
    try:
        engine.check_ready()
    except (CloudUnavailable, CloudTimeout) as e:
        print(f"specsplit-edge: warning: the cloud is not reachable yet ({e.message}); starting anyway, "
              "/readyz answers 503 until it is", file=sys.stderr)


def run(settings: EdgeSettings, args: ServeArgs, log_level: str = "warning") -> None:
    import uvicorn

    check_port(args.host, args.port)
    engine = build_engine(settings, args.choose_draft)
    check_cloud(engine)  # a refused key or a mismatched pair raises: the start stops with one line
    # log_config=None: uvicorn's own lines go through the root logger, in the --log-format chosen
    uvicorn.run(build_app(settings, args, engine), host=args.host, port=args.port, log_level=log_level,
                log_config=None)
