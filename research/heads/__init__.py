"""Feature-fed draft heads, drafting from the target's states the cloud sends (docs/PROTOCOL.md, "Feature-fed
drafting"): the one-state head (feature_head.py), the attention head over past states (attention_head.py,
attention_drafter.py), what their drafters share (head_drafter.py), and `HeadChoice` (head_choice.py), which
plugs a head into the edge by EdgeClient's `states_drafting` hook (edge/states_hook.py)."""

from .head_choice import ATTENTION_HEAD, FEATURE_HEAD, HeadChoice

__all__ = ["ATTENTION_HEAD", "FEATURE_HEAD", "HeadChoice"]
