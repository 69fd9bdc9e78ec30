"""The edge's round policy built from its settings (the layers: edge/policy/__init__.py), and the recovery
policy of its calls: deadlines, retries, and the backoff between attempts of a call that changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.errors import SpecSplitError

from ..exchange import RecoveryPolicy
from ..settings import EdgeSettings
from ..transport.base import ModelInfo, Transport
from ..transport.errors import CloudTimeout, is_retryable, retry_delay
from .deadline import DeadlineConfig
from .k import CostModelK, KController
from .stream import WayControl
from .tree import TreeControl


def recovery_policy(s: EdgeSettings) -> RecoveryPolicy:
    deadline = DeadlineConfig(
        fixed_s=None if s.timeout_ms is None else s.timeout_ms / 1000, first_s=s.deadline_first_ms / 1000,
        floor_s=s.deadline_floor_ms / 1000, ceiling_s=s.deadline_ceiling_ms / 1000,
        multiplier=s.deadline_multiplier)
    return RecoveryPolicy(deadline=deadline, timeout_fallback=s.timeout_fallback,
                          open_timeout_s=s.open_timeout_s, max_retries=s.max_retries,
                          capacity_wait_s=s.capacity_wait_s,
                          backoff_s=s.backoff_ms / 1000, backoff_max_s=s.backoff_max_ms / 1000)


@dataclass
class Backoff:
    """The waits between attempts of a call that changes nothing (retryable errors and timeouts)."""
    policy: RecoveryPolicy
    sleep: Callable[[float], None]
    # attempts retried so far
    attempt: int = 0
    # seconds waited so far
    waited: float = 0.0

    def wait(self, e: SpecSplitError) -> bool:
        """After an attempt failed with `e`: waits and says True for another attempt; False when `e` is final
        (not retryable, or the policy gives up)."""
        if not (is_retryable(e) or isinstance(e, CloudTimeout)) or self.policy.gives_up(self.attempt, e, self.waited):
            return False
        self.attempt += 1
        delay = retry_delay(e, self.policy.backoff(self.attempt))
        self.waited += delay
        self.sleep(delay)
        return True


def k_controller(s: EdgeSettings, policy: str) -> KController | CostModelK:
    """The draft length's controller: a fixed k, the cost model ("cost") or the acceptance rule ("dynamic")."""
    k_min = s.k_min_for(policy)
    if s.fixed_k is not None:
        return KController(k=s.fixed_k, k_min=s.fixed_k, k_max=max(s.fixed_k, 1), dynamic=False)
    if policy == "cost":
        return CostModelK(k=s.k_start, k_min=k_min, k_max=s.k_max)
    return KController(k=s.k_start, k_min=k_min, k_max=s.k_max, up_at=s.k_up_at, down_at=s.k_down_at)


def tree_control(s: EdgeSettings, info: ModelInfo) -> TreeControl | None:
    """The tree controller of the settings, or None for chains (off, a fixed k under auto, gating, or a
    cloud that takes no trees)."""
    if s.tree == "off" or info.max_tree_nodes <= 0 or s.gating or (s.tree == "auto" and s.fixed_k is not None):
        return None
    most = min(s.tree_max_nodes, info.max_tree_nodes)
    fixed = None if s.tree == "auto" else min(int(s.tree), info.max_tree_nodes)
    return TreeControl(max_nodes=most, width=s.tree_width, depth=s.tree_depth, fixed_nodes=fixed,
                       copy_branches=s.tree_copy)


def way_control(s: EdgeSettings, info: ModelInfo, transport: Transport, last: WayControl | None) -> WayControl | None:
    """The speculate-or-stream controller, when the settings allow it and the cloud streams on a session; it
    starts from the costs `last` (the previous session's controller) measured."""
    if not s.stream_switch or not info.session_stream or not getattr(transport, "supports_session_stream", False):
        return None
    # chunks within the cloud's --max-generate-tokens (an older cloud does not say: 0)
    return WayControl(objective=s.objective).carry(last).limit(int(getattr(info, "max_generate_tokens", 0) or 0))
