"""A feature-fed head as the edge's states hook (`HeadChoice`, an edge/states_hook.py `StatesDrafting`): which
encoding of the cloud's states to ask for, whether the head was trained on the cloud's target (read from its
config, without its weights), loading it once, and the drafter around it (research/heads/feature_head.py,
research/heads/attention_drafter.py).

    client = EdgeClient(EdgeSettings(...), states_drafting=HeadChoice("research/models/smollm2-135m-attention-head"))
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from edge.drafters.base import Drafter
from edge.states_hook import StatesFed
from edge.transport.base import ModelInfo
from shared.kvpool import UnsupportedModel

log = logging.getLogger(__name__)

# the real pair's heads: the attention head (fed the target's state at every committed position), and the
# one-state feature-fed head
RESEARCH_MODELS = Path(__file__).resolve().parent.parent / "models"
ATTENTION_HEAD = RESEARCH_MODELS / "smollm2-135m-attention-head"
FEATURE_HEAD = RESEARCH_MODELS / "smollm2-135m-head"


def trained_for(width: int, fingerprint: str, info: ModelInfo) -> bool:
    """Whether a head of this width and tokenizer fingerprint ("": unrecorded) fits the cloud's target."""
    return width == info.feature_size and fingerprint in ("", info.tokenizer_fingerprint)


class HeadChoice:
    """The head in `head_dir`, loaded once and only for a cloud whose target it was trained on (a head for another
    target is said once and drafting goes on without it). Read-only once loaded, so one may serve many clients."""

    def __init__(self, head_dir: str | Path, *, feature_encoding: Literal["auto", "float16", "int8"] = "auto",
                 open_states: int = 16, device: str = "cpu", head: Any = None):
        self.head_dir = Path(head_dir)
        # how the cloud sends the target's states: float16, int8, or auto (int8 when offered, else float16)
        self.feature_encoding = feature_encoding
        # with a head that attends over past states: the prompt's last N states an open (or a reopen) asks for, at
        # most the head's window (16 draft as well as its whole window of 64 for a quarter of the bytes:
        # research/README.md, "The open's states")
        self.open_states = open_states
        # torch device of the head
        self.device = device
        # the loaded head (a FeatureHead or an AttentionHead); None until then
        self._head = head
        # a head for another target was said
        self._warned = False

    def head(self) -> Any:
        """The head (loaded once)."""
        if self._head is None:
            from .attention_head import AttentionHead, is_attention_head
            from .feature_head import FeatureHead, is_feature_head

            if is_attention_head(self.head_dir):
                self._head = AttentionHead.load(self.head_dir, self.device)
            elif is_feature_head(self.head_dir):
                self._head = FeatureHead.load(self.head_dir, self.device)
            else:
                raise UnsupportedModel(f"{self.head_dir} holds no feature-fed head (feature_head.json or "
                                       "attention_head.json)")
        return self._head

    def encoding_for(self, info: ModelInfo) -> str:
        """The feature encoding to ask for: the setting's when the cloud offers it; "auto": int8, else float16."""
        want = self.feature_encoding
        for e in (("int8", "float16") if want == "auto" else (want,)):
            if e in info.feature_encodings:
                return e
        return ""

    def _head_fits(self, info: ModelInfo) -> bool:
        """The head's config (read without its weights) names the cloud's width and tokenizer: a head made
        for another target is never loaded."""
        if self._head is not None:
            cfg = self._head.cfg
            if trained_for(cfg.hidden_size, cfg.tokenizer_fingerprint, info):
                return True
            self._other_target(cfg.hidden_size, cfg.tokenizer_fingerprint, info)
            return False
        from .attention_head import CONFIG_NAME as ATTENTION_CONFIG
        from .feature_head import CONFIG_NAME as FEATURE_CONFIG

        for name in (ATTENTION_CONFIG, FEATURE_CONFIG):
            path = self.head_dir / name
            if path.is_file():
                cfg = json.loads(path.read_text())
                width, fingerprint = int(cfg.get("hidden_size", 0)), str(cfg.get("tokenizer_fingerprint", ""))
                if trained_for(width, fingerprint, info):
                    return True
                self._other_target(width, fingerprint, info)
                return False
        return True  # not a head directory: head() names the problem

    def fed(self, info: ModelInfo, drafter: Drafter) -> StatesFed | None:
        """`drafter` wrapped by the head when the cloud offers states the head was trained on."""
        encoding = self.encoding_for(info)
        if not (info.feature_size and encoding and self._head_fits(info)):
            return None
        from .attention_drafter import AttentionDrafter
        from .attention_head import AttentionHead
        from .feature_head import FeatureDrafter

        head = self.head()
        if isinstance(head, AttentionHead):
            # a drafter that attends over past states asks for every committed position's
            wrapped = AttentionDrafter(head, drafter)
            return StatesFed(wrapped, encoding, min(wrapped.states_window, self.open_states))
        return StatesFed(FeatureDrafter(head, drafter), encoding)

    def _other_target(self, width: int, fingerprint: str, info: ModelInfo) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning("the head %s was trained on another target (width %d, tokenizer %s; the cloud's: %d, %s): "
                    "drafting without it", self.head_dir, width, fingerprint, info.feature_size,
                    info.tokenizer_fingerprint)
