"""Tensor-parallel verification: one verifier whose target is split over the ranks `torchrun` starts.

    torchrun --nproc-per-node N --no-python specsplit-cloud --model DIR ...

Every rank loads its shard of the target by transformers' tensor plan (the model's `base_model_tp_plan`:
attention heads and MLP columns split over the ranks, the embedding and the output layer by vocabulary) and runs
the same forward as one process (cloud/runners/model_forward.py, eagerly), over its shards: the
families it runs (Llama, Qwen2, Qwen3, Mistral) are the ones a group serves. Without torchrun (no WORLD_SIZE, or 1)
none of this runs.

Roles. Rank 0 is the verifier of one process: REST, gRPC, the scheduler, the sessions and the block
manager. Each forward is planned there (the rows' blocks, copy-on-write pairs, the executor's host inputs), then
the plan goes to every rank (`Op`, by `broadcast_object_list`) and every rank runs it on its own share of the KV
heads, so the block tables are the same everywhere; every rank gathers the logits, and verify, residual and
sampling run once, on rank 0. Ranks > 0 run `serve_worker`: receive an op, run it, discard the output, until
`stop`. The start-up (load, `prepare`, `check_rollback`, seeded) runs alike on every rank without messages, each
rank holding its `lock` (no `idle` op among the load's collectives).

Batch invariance. A row's logits are the same bits whatever shares its forward (shared/invariant.py),
for a given group size (they are not one process's bits: its sums are split otherwise). Each rank's
linear layers run their local products in whole tiles of ROW_TILE rows, attention in shared/invariant.py's chunks
on a CPU. The one sum over the ranks, of a rowwise layer's partial products (attention's output projection, the
MLP's down projection) and of the embedding's partial lookups, is `ordered_sum`: an all-gather, then
((x_0 + x_1) + x_2) + ... element by element. An all-reduce would not do from 3 ranks on: gloo's ring
cuts the buffer by its size, so an element's parts are added in another order when the row count
changes. Cost: the gather brings every rank n - 1 partial products where a ring all-reduce moves
2 (n - 1) / n of one. The output layer's shards are gathered (`gather_columns`), exact.

Memory. Each rank's KV pool holds its own KV heads, so `--kv-budget-bytes` is per rank; the block
count (budget // bytes of one block of the local heads) is the same on every rank because the heads
split evenly (`check_splits`), and rank 0's pool size is sent with `use_pool`.

Failure. Every rank bumps a counter in torchrun's store every `BEAT_S` from a thread, unless its main
thread has been inside one op (a forward, a move) for more than `--tp-op-timeout-s` (`OpWatch`; default
`OP_STALE_S`, at least `OP_STALE_FLOOR_S`): a rank whose serving loop hangs stops beating although its
heartbeat thread runs. Raise it when one forward (a prefill chunk of `--max-batch-tokens` of a large
target, on CPU over gloo) can take longer, or the group is restarted in the middle of it. Rank 0 watches the
workers' counters and each worker rank 0's. A counter that has not moved for `STALE_S` (a rank that died, hangs
or was stopped; a counter still at 0, no beat yet, `START_GRACE_S` more) makes rank 0 unready (`/readyz` 503;
new calls and forwards answer 503 with Retry-After) and, `EXIT_GRACE_S` later, exit with status 3, so torchrun
tears the group down and an orchestrator restarts it; a worker that loses rank 0 exits at once. Collectives of the
process group time out after `COLLECTIVE_TIMEOUT_S`; an idle rank 0 sends `idle` every `IDLE_S` so
a waiting worker never reaches that timeout.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cloud.runners.graphs import EagerStep
from cloud.runners.model_forward import FAMILIES
from cloud.settings import OP_STALE_FLOOR_S, OP_STALE_S
from shared.kvpool import UnsupportedModel

log = logging.getLogger(__name__)
# seconds between two heartbeats of a rank
BEAT_S = 0.5
# a rank whose heartbeat has not moved for this long is lost: a beat is a round trip to torchrun's store per
# watched rank, and on a 2-core host with three ranks and a test suite beside them one round trip took up to 0.25 s
# and a rank's beats came up to 1.3 s apart (2.5 s lost a healthy group in two CI runs)
STALE_S = 10.0
# a watched rank's first beat may come this much later than STALE_S (the ranks reach the group at different
# times on a loaded host; a rank whose process dies is torchrun's to see, at any time)
START_GRACE_S = 30.0
# seconds one call to torchrun's store may take (a store that is gone answers at once; a slow host is slow)
STORE_TIMEOUT_S = 15.0
# seconds rank 0 stays up (unready, answering 503) after losing a rank, then it exits
EXIT_GRACE_S = 3.0
# exit status of a rank that lost another
EXIT_RANK_LOST = 3
# timeout of one collective (a forward's all-reduce waits at most this long for the slowest rank)
COLLECTIVE_TIMEOUT_S = 60.0
# an idle rank 0 sends `idle` this often, so workers waiting for the next op never time out
IDLE_S = 10.0


def world_size(env: dict[str, str] | None = None) -> int:
    """The number of ranks torchrun started (1 without torchrun)."""
    return int((os.environ if env is None else env).get("WORLD_SIZE", "1") or 1)


def check_splits(config: Any, n: int) -> None:
    """UnsupportedModel (one line) unless `config`'s architecture has a tensor plan and its heads split
    over `n` ranks."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(cfg, "model_type", "?")
    if name not in FAMILIES:
        raise UnsupportedModel(f"model type {name!r}: tensor parallelism runs {', '.join(FAMILIES)}; serve it from "
                               "one process (without torchrun)")
    if not getattr(cfg, "base_model_tp_plan", None):
        raise UnsupportedModel(f"model type {name!r} has no tensor-parallel plan in transformers; serve it from one "
                               "process (without torchrun)")
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    inner = int(getattr(cfg, "intermediate_size", 0) or 0)
    common = math.gcd(math.gcd(heads, kv), inner)
    if heads == 0 or common % n:
        works = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
        if math.gcd(heads, kv) % n == 0:  # the heads split, the MLP does not
            raise UnsupportedModel(f"model type {name!r}: {heads} attention heads, {kv} KV heads and an MLP width "
                                   f"of {inner} do not all split over {n} ranks; --nproc-per-node must divide them: "
                                   f"{works}")
        raise UnsupportedModel(f"model type {name!r}: {heads} attention heads and {kv} KV heads do not split over "
                               f"{n} ranks; --nproc-per-node must divide both: {works}")


def ordered_sum(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The sum of every rank's `x` (the same shape on each) in rank order, ((x_0 + x_1) + x_2) + ...,
    element by element: each element's result depends on its own parts only. An all-gather, then adds."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def gather_columns(x: torch.Tensor, sizes: list[int], group: Any = None) -> torch.Tensor:
    """Every rank's columns of x side by side, in rank order (rank r holds `sizes[r]` of them): an exact gather."""
    width = max(sizes)
    parts = [torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device) for _ in sizes]
    dist.all_gather(parts, torch.nn.functional.pad(x, (0, width - x.shape[1])).contiguous(), group=group)
    return torch.cat([part[:, :n] for part, n in zip(parts, sizes, strict=True)], dim=1)


@dataclass
class Op:
    """What every rank does next (rank 0 sends it, workers mirror it)."""
    # "forward" (grow the pool to `capacity` blocks, copy the blocks of `copies`, run `step`), "use_pool" (a fresh
    # pool: `pool` = (budget bytes, block size, prefix cache, preallocate)), "move" (copy KV pool rows: a token
    # tree's accepted path, `moves` = (source, destination) rows), "idle" (nothing: keeps the workers' wait under
    # the collective timeout), "stop"
    kind: str
    step: EagerStep | None = None
    capacity: int = 0
    copies: list[tuple[int, int]] | None = None
    pool: tuple[int | None, int, bool, bool | str] | None = None
    moves: list[tuple[int, int]] | None = None


class OpWatch:
    """When the main thread entered the op it is inside (`with watch:`), so the heartbeat thread can tell a
    serving loop that hangs from one that waits for work."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._since: float | None = None

    def __enter__(self) -> OpWatch:
        self._since = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self._since = None

    def hung(self, limit: float = OP_STALE_S) -> bool:
        """Whether the op under way started more than `limit` seconds ago."""
        since = self._since
        return since is not None and self.clock() - since > limit


class TensorGroup:
    """This process's place in the group: rank, size, the op broadcast, heartbeats and health."""

    # seconds inside one op after which this rank counts as hung and stops beating (--tp-op-timeout-s)
    op_stale_s: float = OP_STALE_S

    def __init__(self, device: str = "cpu", op_stale_s: float = OP_STALE_S) -> None:
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        # every rank uses its own GPU: "cuda" (or "cuda:K") becomes cuda:LOCAL_RANK
        self.device = f"cuda:{local}" if device.startswith("cuda") else device
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # held by whoever uses the process group (a forward: plan, broadcast and run; the model's load), so
        # an idle op never interleaves its broadcast with a forward's collectives
        self.lock = threading.Lock()
        # the op the main thread is inside (a forward, a move): no heartbeat once it has run `op_stale_s`
        self.watch = OpWatch()
        self.op_stale_s = max(op_stale_s, OP_STALE_FLOOR_S)
        self._last_op = time.monotonic()
        self._lost: str | None = None
        self._store = _heartbeat_store()
        # ranks this one watches, and when each one's counter last moved
        self._watch_ranks(time.monotonic())
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True)]
        if self.rank == 0:
            self._threads.append(threading.Thread(target=self._keep_alive, name="tp-idle", daemon=True))
        for t in self._threads:
            t.start()
        log.info("tensor-parallel rank %d of %d (%s)", self.rank, self.size, backend)

    # --- ops --------------------------------------------------------------------------------
    def send(self, op: Op) -> None:
        """Rank 0: every worker receives `op` (the caller holds `lock` when it then runs collectives)."""
        dist.broadcast_object_list([op], src=0)
        self._last_op = time.monotonic()

    def receive(self) -> Op:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Rank 0 at shutdown: the workers leave their loop."""
        self._stop.set()
        if self._lost is None:
            with self.lock:
                self.send(Op("stop"))

    def close(self) -> None:
        """Every rank at exit: its heartbeat threads end before the process group does (a thread left
        inside a store call while the interpreter exits aborts the process)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=IDLE_S)
        dist.destroy_process_group()

    # --- health -----------------------------------------------------------------------------
    def lost(self) -> str | None:
        """Why this group cannot serve (a rank stopped beating), or None."""
        return self._lost

    def _watch_ranks(self, now: float) -> None:
        """The ranks this one watches (rank 0 the workers, a worker rank 0), none seen yet: each has
        START_GRACE_S + STALE_S from `now` for its first beat."""
        self._watch = [r for r in range(1, self.size)] if self.rank == 0 else [0]
        self._seen: dict[int, tuple[int, float]] = {r: (-1, now + START_GRACE_S) for r in self._watch}

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat_once(time.monotonic())

    def _beat_once(self, now: float) -> None:
        """Bump this rank's counter (not while its main thread hangs in an op) and check the watched ones."""
        try:
            self._store.add(f"specsplit/beat/{self.rank}", 0 if self.watch.hung(self.op_stale_s) else 1)
            for r in self._watch:
                count = self._store.add(f"specsplit/beat/{r}", 0)
                if count and count != self._seen[r][0]:  # 0: no beat yet, the start grace still runs
                    self._seen[r] = (count, now)
        except Exception as e:  # noqa: BLE001 - the store went away with torchrun's agent
            self.fail(f"torchrun's store is gone ({type(e).__name__})")
            return
        stale = [r for r in self._watch if now - self._seen[r][1] > STALE_S]
        if stale:
            self.fail(f"tensor-parallel rank {stale[0]} has not answered for {STALE_S:g} s")

    def _keep_alive(self) -> None:
        """Rank 0: `idle` to the workers after IDLE_S without an op (its own thread: a broadcast to a
        dead rank may block, and the heartbeats must go on meanwhile)."""
        while not self._stop.wait(IDLE_S / 4):
            if self._lost is not None or time.monotonic() - self._last_op <= IDLE_S:
                continue
            if self.lock.acquire(blocking=False):  # else a forward is under way: no need
                try:
                    self.send(Op("idle"))
                except Exception as e:  # noqa: BLE001 - a rank is gone
                    self.fail(f"a broadcast to the tensor-parallel ranks failed ({type(e).__name__})")
                finally:
                    self.lock.release()

    def fail(self, why: str) -> None:
        """This group cannot serve any more: rank 0 turns unready and exits EXIT_GRACE_S later; another
        rank exits at once."""
        if self._lost is not None:
            return
        self._lost = why
        if self.rank != 0:
            log.error("%s: this rank exits", why)
            os._exit(EXIT_RANK_LOST)
        log.error("%s: unready; exiting in %g s", why, EXIT_GRACE_S)
        threading.Timer(EXIT_GRACE_S, os._exit, (EXIT_RANK_LOST,)).start()


def _heartbeat_store() -> dist.Store:
    """A client of torchrun's store (MASTER_ADDR:MASTER_PORT), apart from the process group's."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=STORE_TIMEOUT_S))


def serve_worker(model: Any, group: TensorGroup) -> int:
    """Ranks > 0: mirror rank 0's ops on the local shard of `model` (a TargetModel) until `stop`.
    SIGTERM and SIGINT (torchrun passes them to every rank) are ignored: rank 0 drains, then sends
    `stop`; a worker whose rank 0 is gone exits by its heartbeat."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        op = group.receive()
        with group.watch:
            if _run_op(model, op):
                return 0


def _run_op(model: Any, op: Op) -> bool:
    """A worker runs one op; True when it is `stop`."""
    if op.kind == "forward":
        assert op.step is not None
        model.run_step(op)
    elif op.kind == "use_pool":
        assert op.pool is not None
        model.use_pool(*op.pool)
    elif op.kind == "move":
        assert op.moves is not None
        model.pool.move_rows(op.moves)
    return op.kind == "stop"
