"""Room in the KV pool when a forward lacks blocks: the eviction policy, on the model thread.

The scheduler asks for `blocks` more KV blocks than are left (cached prefix blocks already count as
available). First half-finished prefills (of opens and of /v1/generate) waiting for a later forward give
their blocks back (their full blocks stay in the prefix cache, so they resume from there); then least
recently used idle sessions are evicted until the blocks fit, sparing those opened within
`eviction_grace_s` that have not run a round yet and those used within `eviction_active_s`. The work that
lacks blocks then waits for a later forward (or answers 429), instead of evicting a session whose edge is
mid-generation. Each evicted session answers 404 afterwards; its edge reopens it with the full context.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cloud.prefill import DecodeState, Prefill
from cloud.runners import Runner
from cloud.settings import CloudSettings
from cloud.store import KV_BUDGET, SessionStore


class Eviction:
    """The work that holds KV blocks between forwards (model thread only), and who gives blocks back."""

    def __init__(self, settings: CloudSettings, model: Runner, store: SessionStore,
                 clock: Callable[[], float]) -> None:
        self.settings, self.model, self.store, self.clock = settings, model, store, clock
        # prefills under way (model thread only): an open sharing a full block they are computing waits
        self.prefilling: list[Prefill] = []
        # /v1/generate prompts half prefilled, waiting for their next chunk (model thread only)
        self.gen_prefilling: list[DecodeState] = []
        # prefills whose row is in the forward being built or run (model thread only): never evicted for blocks
        self.in_forward: set[int] = set()
        # the event loop the store lives on (set by the calls that submit work): evictions are dropped there
        self.loop: asyncio.AbstractEventLoop | None = None

    def shares_a_running_prefill(self, pre: Prefill) -> bool:
        """Whether another prefill under way, under the same salt, is still computing a full block that
        `pre` would need too: `pre` then waits and takes those blocks from the prefix cache instead of
        computing them again."""
        if not self.settings.prefix_cache:
            return False
        size = self.model.pool.block_size
        for other in self.prefilling:
            if other is pre or other.salt != pre.salt or other.seq_id is None:
                continue
            if pre.ids[:size] != other.ids[:size]:  # no full block in common: the usual case, at a block's cost
                continue
            n = 0
            for a, b in zip(pre.ids, other.ids, strict=False):
                if a != b:
                    break
                n += 1
            if n // size * size > other.done:  # a shared full block is not computed yet
                return True
        return False

    def forget_generate(self, st: DecodeState) -> None:
        self.gen_prefilling = [g for g in self.gen_prefilling if g is not st]

    def end_generate(self, st: DecodeState) -> None:
        """A generation is over (model thread, between forwards): its blocks go back."""
        self.forget_generate(st)
        self.in_forward.discard(id(st))
        st.give_back(self.model.pool)

    def forget_prefill(self, pre: Prefill) -> None:
        """`pre` is done, failed or gave its sequence back: no open waits for it any more (model thread)."""
        self.prefilling = [p for p in self.prefilling if p is not pre]

    def make_room(self, blocks: int, progressing: bool = False) -> None:
        """On the model thread, when a forward needs `blocks` more KV blocks than are left: the policy in
        the module docstring. `progressing` (always set by the scheduler) means the forward runs other work,
        so sessions used within `eviction_active_s` are spared."""
        pool = self.model.pool
        goal = pool.manager.available() + blocks
        for pre in list(self.prefilling):
            if pool.manager.available() >= goal:
                return
            if id(pre) not in self.in_forward and pre.seq_id is not None and pre.done > pre.reused:
                self.forget_prefill(pre)
                pool.release(pre.seq_id)
                pre.seq_id, pre.done, pre.reused = None, 0, 0  # plans again: allocate, match the prefix cache
        for st in list(self.gen_prefilling):  # /v1/generate prompts alike
            if pool.manager.available() >= goal:
                return
            if id(st) not in self.in_forward and st.seq_id is not None and st.kv_len > st.matched:
                self.forget_generate(st)
                st.give_back(pool)
        now = self.clock()
        fresh_since = now - self.settings.eviction_grace_s
        active_since = now - self.settings.eviction_active_s if progressing else now + 1.0
        for s in self.store.lru():
            if pool.manager.available() >= goal:
                return
            if s.inflight > 0 or s.closed or s.seq_id is None:
                continue
            if s.counters.rounds == 0 and s.created > fresh_since:
                continue  # just opened or reopened: evicting it now would only make its edge reopen again
            if s.last_used > active_since:
                continue  # mid-generation, and this forward runs other work: the newcomer waits
            seq_id, s.seq_id = s.seq_id, None
            s.closed = True
            pool.release(seq_id)
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.store.drop, s, KV_BUDGET)
            else:
                self.store.drop(s, KV_BUDGET)
