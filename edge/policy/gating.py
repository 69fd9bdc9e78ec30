"""Uncertainty gating: decide whether a draft block needs the cloud or may be committed locally.

Per token, from the draft model's raw distribution: hard_i = nll_i > T_nll or H_i > T_H (bits) or
margin_i < T_margin (or MC-dropout variance > T_var where computed). A block with
hard_ratio = mean(hard) > R_hard goes to the cloud, and so does any block whose detokenized text
hits a rule (digits / numbers, dates, amounts). Otherwise it is committed locally, unverified:
lossy by design, and counted. Drafters without signals (n-gram) always go to the cloud.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..drafters.base import DraftBlock

_MONTHS = r"jan(uary)?|feb(ruary)?|mar(ch)?|apr(il)?|may|june?|july?|aug(ust)?|sep(t(ember)?)?|oct(ober)?|nov(ember)?|dec(ember)?"
# digits cover numbers, numeric dates and most amounts; the rest: currency signs, month names
RULE_PATTERN = re.compile(rf"\d|[$€£¥%]|\b({_MONTHS})\b", re.IGNORECASE)


@dataclass(frozen=True)
class GateThresholds:
    # NLL (nats) of the drafted token above this -> hard
    t_nll: float = 2.3
    # entropy (bits) above this -> hard
    t_entropy_bits: float = 2.5
    # top-1 minus top-2 probability below this -> hard
    t_margin: float = 0.2
    # MC-dropout variance above this -> hard (only when computed)
    t_mc_var: float = 0.01
    # blocks with hard_ratio above this go to the cloud
    r_hard: float = 0.3


@dataclass(frozen=True)
class GateDecision:
    # 0/1 per draft token
    hard_mask: list[int]
    # mean of hard_mask (1.0 when the drafter gives no signals)
    hard_ratio: float
    # a rule (digits, dates, amounts) matched the detokenized draft
    triggered: bool
    # True -> verify with the cloud; False -> commit locally
    to_cloud: bool


def hard_mask(block: DraftBlock, th: GateThresholds) -> list[int]:
    """The per-token hard flags; all hard when the drafter has no signals."""
    if block.nll is None or block.entropy_bits is None or block.margin is None:
        return [1] * block.k
    mc = block.mc_var if block.mc_var is not None else [0.0] * block.k
    return [int(n > th.t_nll or h > th.t_entropy_bits or m < th.t_margin or v > th.t_mc_var)
            for n, h, m, v in zip(block.nll, block.entropy_bits, block.margin, mc, strict=True)]


def rule_triggered(text: str) -> bool:
    return RULE_PATTERN.search(text) is not None


def decide(block: DraftBlock, text: str, th: GateThresholds, rules: bool = True) -> GateDecision:
    """Gate one block; `text` is its detokenized draft."""
    mask = hard_mask(block, th)
    ratio = sum(mask) / len(mask) if mask else 1.0
    triggered = rules and rule_triggered(text)
    return GateDecision(mask, ratio, triggered, to_cloud=block.k == 0 or triggered or ratio > th.r_hard)
