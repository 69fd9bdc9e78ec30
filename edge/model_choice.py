"""Which model under models/ speaks the cloud's tokenizer, asked before the edge tokenizes anything.

The cloud names its tokenizer in GET /v1/model (`tokenizer_fingerprint`, shared/tokenizer_id.py). Without
`--draft` (and, in cloud_only mode, without `--tokenizer`) the edge looks at every folder under models/ whose
tokenizer has that fingerprint: the bundled drafts first in their order of preference (CLOUD_DRAFTS), then any
other folder, one's own models included (`models/NAME`), those with the target's logit rows and then the
smallest weights first (a draft should be small). A draft needs weights too (config.json or model.gguf); cloud_only
needs the tokenizer alone. edge/cli.py (generate, serve) and edge/server/openai_engine.py (a server whose cloud
answers only later) call these.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from shared.errors import InvalidArgument, SpecSplitError
from shared.protocol import ModelInfo

from . import settings as edge_settings
from .settings import EdgeSettings

log = logging.getLogger(__name__)

# Drafts a cloud's tokenizer picks first when --draft is not given: the coder pair's draft, then DEFAULT_DRAFTS.
CLOUD_DRAFTS = ("qwen2.5-coder-0.5b-instruct", *edge_settings.DEFAULT_DRAFTS)


def _rows(d: Path) -> int:
    try:
        return int(json.loads((d / "config.json").read_text()).get("vocab_size", 0))
    except (OSError, ValueError, AttributeError):
        return 0


def _weight_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin"))


def _is_draft(d: Path) -> bool:
    """Weights a drafter loads: a Hugging Face directory or a prepared one with model.gguf (feature-fed heads,
    which hold neither, are not drafts)."""
    return (d / "config.json").is_file() or (d / "model.gguf").is_file()


def models_speaking(fingerprint: str, vocab_size: int, drafts_only: bool) -> list[Path]:
    """The folders under models/ whose tokenizer has `fingerprint`, in the order of preference above."""
    from shared.tokenizer_id import directory_fingerprint

    root = edge_settings.REPO_ROOT / "models"
    if not root.is_dir():
        return []
    folders = [d for d in sorted(root.iterdir()) if d.is_dir() and (_is_draft(d) or not drafts_only)]

    def rank(d: Path) -> tuple[int, int, int]:
        named = CLOUD_DRAFTS.index(d.name) if d.name in CLOUD_DRAFTS else len(CLOUD_DRAFTS)
        return (named, _rows(d) != vocab_size, _weight_bytes(d))

    return [d for d in sorted(folders, key=rank) if directory_fingerprint(d) == fingerprint]


def draft_for_tokenizer(fingerprint: str, vocab_size: int) -> str | None:
    """The preferred draft under models/ whose tokenizer has `fingerprint`; None when none does."""
    found = models_speaking(fingerprint, vocab_size, drafts_only=True)
    return str(found[0]) if found else None


def ask_cloud(settings: EdgeSettings) -> ModelInfo | None:
    """The cloud's model (GET /v1/model, or the gRPC call), None when it does not answer in 5 s."""
    from .transport import transport_for

    transport = transport_for(settings)
    try:
        return transport.get_model(5.0)
    except SpecSplitError:
        return None
    finally:
        transport.close()


def choose_draft(info: ModelInfo, default: str) -> str:
    """The draft under models/ that speaks `info`'s tokenizer, else `default` with one warning line."""
    chosen = draft_for_tokenizer(info.tokenizer_fingerprint, info.vocab_size) if info.tokenizer_fingerprint else None
    if chosen is None:
        log.warning("no draft under models/ speaks the cloud's tokenizer (%s): drafting with %s; pass --draft DIR "
                    "(or --draft ngram --tokenizer DIR)", info.tokenizer_fingerprint or "no fingerprint", default)
    elif chosen != default:
        log.info("drafting with %s: it speaks the cloud's tokenizer", chosen)
    return chosen or default


def choose_tokenizer(info: ModelInfo) -> str | None:
    """cloud_only: the folder under models/ whose tokenizer is the cloud's; None when the cloud names none (an
    older cloud: the pairing check cannot tell); InvalidArgument naming --tokenizer / --draft when none is."""
    if not info.tokenizer_fingerprint:
        return None
    found = models_speaking(info.tokenizer_fingerprint, info.vocab_size, drafts_only=False)
    if not found:
        raise InvalidArgument(f"no folder under models/ holds the cloud's tokenizer ({info.model_id}, fingerprint "
                              f"{info.tokenizer_fingerprint}): pass --tokenizer DIR with its tokenizer files (or "
                              "--draft DIR with a draft that speaks it)")
    log.info("tokenizing with %s: it speaks the cloud's tokenizer", found[0])
    return str(found[0])


def for_cloud(settings: EdgeSettings, info: ModelInfo) -> EdgeSettings:
    """The settings with what `info`'s tokenizer asks for: in cloud_only mode the tokenizer (the prompt is
    tokenized, the cloud's ids decoded with it), else the draft (and with it the tokenizer)."""
    if settings.mode == "cloud_only":
        tokenizer = choose_tokenizer(info)
        return settings if tokenizer is None else settings.model_copy(update={"tokenizer": tokenizer})
    return settings.model_copy(update={"draft": choose_draft(info, settings.draft)})
