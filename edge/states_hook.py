"""The hook by which a drafter fed the target's states plugs into the edge (research/heads/ holds the ones that do).

The product's drafters draft from tokens alone. The wire still carries the target's states (docs/PROTOCOL.md,
"Feature-fed drafting": an open naming a `feature_encoding`, and a `feature_window`), so a `StatesDrafting` given
to `EdgeClient(states_drafting=...)` may, at each speculative generation, wrap the drafter when the cloud's model
offers states it fits. The open then asks for them, and the session hands them to the wrapped drafter
(edge/exchange.py): every state to one with `set_states(S, first, vectors)`, the last as one vector to one with
`set_feature(prefix, vector)`. A wrapped drafter may say per round whether it drafted from them
(`last_from_head`: EdgeMetrics.head_rounds and fallback_rounds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .drafters.base import Drafter
from .transport.base import ModelInfo


@dataclass
class StatesFed:
    # the drafter that takes the cloud's states (set_feature / set_states) and drafts from them
    drafter: Drafter
    # the encoding the open asks for: one of the cloud's ModelInfo.feature_encodings ("float16", "int8")
    encoding: str
    # states an open asks for (the prompt's last N, then every committed position's); 0: one vector a round.
    # The client caps it at the cloud's max_feature_window
    window: int = 0


class StatesDrafting(Protocol):
    def fed(self, info: ModelInfo, drafter: Drafter) -> StatesFed | None:
        """`drafter` wrapped to draft from the states of the cloud described by `info`, with what the open asks
        for; None: this generation drafts with `drafter` alone and asks for no states."""
        ...
