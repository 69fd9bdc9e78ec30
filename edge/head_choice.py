"""The edge client's feature-fed head (`HeadChoice`, a part of `EdgeClient`): which encoding of the cloud's
states to ask for, whether the settings' head was trained on the cloud's target (read from its config, without
its weights), loading it once, and the drafter around it (edge/drafters/feature_head.py,
edge/drafters/attention_drafter.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .drafters.base import Drafter
from .settings import EdgeSettings, default_head
from .solo_modes import NoDrafter
from .transport.base import ModelInfo

log = logging.getLogger(__name__)


def trained_for(width: int, fingerprint: str, info: ModelInfo) -> bool:
    """Whether a head of this width and tokenizer fingerprint ("": unrecorded) fits the cloud's target."""
    return width == info.feature_size and fingerprint in ("", info.tokenizer_fingerprint)


class HeadChoice:
    """EdgeClient's choice of the settings' head: loaded once and only for a cloud whose target it was trained on
    (a head for another target is said once, quietly for the default head, and drafting goes on without it)."""

    settings: EdgeSettings
    # the loaded head (a FeatureHead or an AttentionHead; read-only, so one may serve many clients); None until then
    _head: Any
    # a head for another target was said
    _head_warned: bool

    def head(self) -> Any:
        """The feature-fed head of the settings (loaded once), or None for "none"."""
        if self.settings.head == "none":
            return None
        if self._head is None:
            from .drafters.attention_head import AttentionHead, is_attention_head
            from .drafters.feature_head import FeatureHead, is_feature_head

            if is_attention_head(self.settings.head):
                self._head = AttentionHead.load(Path(self.settings.head), self.settings.device)
            elif is_feature_head(self.settings.head):
                self._head = FeatureHead.load(Path(self.settings.head), self.settings.device)
            else:
                from shared.kvpool import UnsupportedModel
                raise UnsupportedModel(f"{self.settings.head} holds no feature-fed head (feature_head.json or "
                                       "attention_head.json): pass --head DIR or --head none")
        return self._head

    def encoding_for(self, info: ModelInfo) -> str:
        """The feature encoding to ask for: the setting's when the cloud offers it; "auto": int8, else float16."""
        want = self.settings.feature_encoding
        for e in (("int8", "float16") if want == "auto" else (want,)):
            if e in info.feature_encodings:
                return e
        return ""

    def _head_fits(self, info: ModelInfo) -> bool:
        """The head's config (read without its weights) names the cloud's width and tokenizer: a head made
        for another target is never loaded."""
        if self.settings.head == "none":
            return False
        if self._head is not None:
            return True
        from .drafters.attention_head import CONFIG_NAME as ATTENTION_CONFIG
        from .drafters.feature_head import CONFIG_NAME as FEATURE_CONFIG

        for name in (ATTENTION_CONFIG, FEATURE_CONFIG):
            path = Path(self.settings.head) / name
            if path.is_file():
                cfg = json.loads(path.read_text())
                width, fingerprint = int(cfg.get("hidden_size", 0)), str(cfg.get("tokenizer_fingerprint", ""))
                if trained_for(width, fingerprint, info):
                    return True
                self._other_target("the head", width, fingerprint, info, " (not loaded)")
                return False
        return True  # not a head directory: head() names the problem

    def _feature_fed(self, info: ModelInfo, drafter: Drafter) -> Drafter | None:
        """`drafter` wrapped by the feature-fed head when the cloud offers features the head was trained on."""
        if isinstance(drafter, NoDrafter) or not (info.feature_size and self.encoding_for(info)
                                                  and self._head_fits(info) and self.head() is not None):
            return None
        from .drafters.attention_drafter import AttentionDrafter
        from .drafters.attention_head import AttentionHead
        from .drafters.feature_head import FeatureDrafter

        cfg = self._head.cfg
        if trained_for(cfg.hidden_size, cfg.tokenizer_fingerprint, info):
            if isinstance(self._head, AttentionHead):
                return AttentionDrafter(self._head, drafter)
            return FeatureDrafter(self._head, drafter)
        self._other_target("the feature-fed head", cfg.hidden_size, cfg.tokenizer_fingerprint, info, "")
        return None

    def _other_target(self, what: str, width: int, fingerprint: str, info: ModelInfo, note: str) -> None:
        if self._head_warned:
            return
        self._head_warned = True
        quiet = self.settings.head == default_head()  # the default head meets other targets silently
        (log.info if quiet else log.warning)(
            "%s %s was trained on another target (width %d, tokenizer %s; the cloud's: %d, %s): drafting without "
            "it%s", what, self.settings.head, width, fingerprint, info.feature_size, info.tokenizer_fingerprint, note)
