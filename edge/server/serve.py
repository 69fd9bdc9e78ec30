"""`specsplit-edge serve`: the OpenAI-compatible server, built from EdgeSettings and run by uvicorn.

The draft model and the tokenizer load once at start-up; the cloud's model info is asked for on
the first request that needs it (so the server may start before the cloud is reachable).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from ..settings import EdgeSettings
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


def build_app(settings: EdgeSettings, args: ServeArgs) -> FastAPI:
    from shared.tokenizer_id import load_tokenizer

    tokenizer = load_tokenizer(settings.tokenizer_dir())  # one-line error when the directory has none
    template = load_chat_template(args.chat_template_file, tokenizer)
    engine = OpenAIEngine(settings, SharedDraftModel(settings), LockedTokenizer(tokenizer))
    options = ServeOptions(served_model_name=args.served_model_name, chat_template=template,
                           chat_default_max_tokens=settings.max_new_tokens)
    return create_app(engine, options)


def run(settings: EdgeSettings, args: ServeArgs, log_level: str = "warning") -> None:
    import uvicorn

    uvicorn.run(build_app(settings, args), host=args.host, port=args.port, log_level=log_level)
