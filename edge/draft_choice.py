"""Which draft `specsplit-edge` starts with: the one named (--draft, SPECSPLIT_EDGE_DRAFT), else the one under
models/ that speaks the tokenizer the cloud names (edge/model_choice.py), asked at start-up; a server whose cloud
does not answer yet asks again at the cloud's first answer (edge/server/openai_engine.py).

In cloud_only mode the draft names only the tokenizer: there a --tokenizer (SPECSPLIT_EDGE_TOKENIZER) given
leaves the choice alone too.
"""

from __future__ import annotations

import argparse
import logging
import os

from .model_choice import ask_cloud, for_cloud
from .settings import EdgeSettings

log = logging.getLogger(__name__)


def cloud_chooses(settings: EdgeSettings, args: argparse.Namespace) -> bool:
    """Whether the cloud's tokenizer picks the model: no --draft, and in cloud_only mode no --tokenizer either."""
    if getattr(args, "draft", None) is not None or "SPECSPLIT_EDGE_DRAFT" in os.environ:
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
        tokenizing = settings.mode == "cloud_only"
        log.warning("the cloud did not answer: %s with %s, which may not speak its tokenizer; pass %s to choose",
                    "tokenizing" if tokenizing else "drafting", settings.tokenizer_dir() if tokenizing
                    else settings.draft, "--tokenizer" if tokenizing else "--draft")
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
