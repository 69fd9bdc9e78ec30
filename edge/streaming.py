"""Target-only tokens streamed on a session (PROTOCOL.md "Streaming on a session"), where the way controller
(edge/policy/stream.py) finds streaming cheaper than speculating: the layer between the session's exchange
(edge/exchange.py) and its rounds (edge/speculative.py). Each streamed token is committed as it arrives, so a
chunk cut short loses nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from shared.errors import NotFound, SpecSplitError
from shared.protocol import StreamDone

from .exchange import CloudSession
from .metrics import Origin
from .policy.stream import WayControl
from .prefetch import DraftAhead

log = logging.getLogger(__name__)


class StreamingSession(CloudSession):
    """A cloud session that also streams: `stream(n)` on top of the exchange's open, verify and recovery."""

    way: WayControl | None
    ahead: DraftAhead | None
    stop_at_eos: bool
    _prev_drafted: bool

    def stream(self, n: int) -> Iterator[tuple[int, Origin]]:
        """Up to n target-only tokens streamed on the session (PROTOCOL.md "Streaming on a session"), each
        committed as it arrives. A failure ends the chunk early and never fails the generation: an evicted
        session is reopened by the next round, any other failure ends streaming for the session."""
        assert self.ctx_id is not None and self.way is not None
        t0, got, cloud_ms = self.clock(), 0, 0.0
        self.metrics.cloud_calls += 1
        self.metrics.stream_calls += 1
        self._prev_drafted = False  # the drafter catches up on these tokens before its next draft
        try:
            # each event is one forward away: the verify deadline bounds the wait for it
            for ev in self.transport.stream_session(self.ctx_id, len(self.S), self.hash_at(len(self.S)), n,
                                                    self.stop_at_eos, self.deadline.for_attempt(0)):
                if isinstance(ev, StreamDone):
                    cloud_ms = float(ev.metrics.get("decode_ms", 0.0))
                    if ev.metrics.get("stop_reason") == "speculate":  # the cloud under load asks for rounds
                        self.way.declined()
                    break
                if ev.ctx_len != len(self.S) + 1:
                    log.warning("streamed token at %d, expected %d: reopening next round", ev.ctx_len, len(self.S) + 1)
                    self.ctx_id = None
                    break
                self._extend([ev.token_id])
                self.cloud_len = len(self.S)
                self.node_budget = ev.node_budget
                self._take_feature(ev.feature)
                self._take_states(ev.states)
                got += 1
                self.metrics.streamed += 1
                self.metrics.target_rows += 1
                yield ev.token_id, "target"
                # once the token is out, the draft reads what it lacks while the next ones come, where a probe
                # round will need it (with no probe to come it reads nothing: it would only take CPU from the cloud
                # where both share a machine)
                if self.ahead is not None and self.way.probes:
                    self.ahead.catch_up(self.S)
        except NotFound:
            self.ctx_id = None  # evicted: the next round reopens with the full S
        except SpecSplitError as e:  # refused (422), cut, late: the session itself is intact, rounds go on
            log.info("stream stopped after %d tokens (%s): this session speculates from now on", got, e.code)
            self.way.stream_failed()
        finally:
            self.way.observe_stream(got, (self.clock() - t0) * 1000, cloud_ms)
