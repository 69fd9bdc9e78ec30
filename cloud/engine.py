"""The verify round on a session's KV (a new session's prefill and the target-only decode step: cloud/prefill.py).

Checks that need no session state (`check_request`) run on the event loop before a request
is queued; everything that reads or writes a session's context or KV (`plan_round`,
`finish_round`) runs on the model thread, in the scheduler's batches (cloud/scheduler.py): a
round is planned (the Row it needs), runs in one forward with other sessions' rows, and is
finished with its own k + 1 distributions, so its answer does not depend on its batch.

Positions (PROTOCOL.md): S' = S[:m] + append_ids with |S'| = ctx_len = L; draft y_i sits at
position L + i; one forward over S'[c:] + y_1..y_k gives the k + 1 distributions
p_1..p_{k+1} at positions L + 1 .. L + k + 1. A resync longer than the forward's token budget
runs S'[c:] in prefill chunks first (`RoundPlan.next_row`), then the verify row.

Memory traffic per round (paged pool, shared/kvpool.py): the K/V of the round's new positions
(S'[c:] + y_1..y_k, usually 1 + k or 2 + k of them) are written once per layer; each layer reads
the session's keys and values once (c + k + 1 positions, the window on sliding layers); the
rejected drafts' KV is dropped by a crop (whole blocks past L + La go back to the pool, no copy).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch

from cloud.guards import check_context_room
from cloud.runners import Runner
from cloud.session import Context, Session
from shared.config import SamplingConfig
from shared.errors import ContextMismatch, InvalidArgument, NotFound
from shared.features import encode_feature, encode_states
from shared.protocol import RoundMetrics, SparseDist, VerifyRequest, VerifyResponse
from shared.rows import Row
from shared.sampling import RowSampling, processed_probs
from shared.target_probs import TargetProbs
from shared.tree import TreeOutcome, check_tree, depths, is_chain, verify_tree
from shared.verify import VerifyOutcome, check_draft, dense_from_sparse, verify_round

HASH_RE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class RoundLimits:
    # largest k accepted
    max_k: int
    # largest return_top_k accepted
    max_return_top_k: int
    # the model's positions: ctx_len + k + 1 must fit
    max_context: int
    # rows of the logits: valid ids are [0, vocab_size)
    vocab_size: int
    # most nodes of a token tree (0: chains only)
    max_tree_nodes: int = 0


@dataclass
class RoundResult:
    # the answer (metrics.queue_ms is the caller's to fill)
    response: VerifyResponse
    # the verify rule's full outcome (alphas for logs and metrics); None when replayed
    outcome: VerifyOutcome | TreeOutcome | None
    # answered from the replay cache: no forward, context unchanged
    replayed: bool = False


def check_ids(ids: list[int], vocab: int, what: str) -> None:
    """InvalidArgument naming the first entry that is not a token id in [0, vocab). The usual case (all
    of them are) runs in C (`set(map(type))`, `min`, `max`), not in a Python loop per token: a long prompt
    costs the event loop little ahead of the rounds behind it."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab):
        return
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise InvalidArgument(f"{what}[{i}] = {t!r} is not a token id in [0, {vocab})")


def check_request(req: VerifyRequest, declared_k: int, lim: RoundLimits, session_cfg: SamplingConfig,
                  sampling_cfg: SamplingConfig | None) -> torch.Tensor | None:
    """Every check that needs no session state; returns the dense q_dists ([k, vocab]) if sent."""
    d = req.draft
    k = len(d.draft_tokens)
    if declared_k != k:
        raise InvalidArgument(f"k = {declared_k} but len(draft_tokens) = {k}")
    tree = d.tree_parents is not None
    if tree:
        if k > lim.max_tree_nodes:
            raise InvalidArgument(f"a tree of {k} nodes exceeds the limit max_tree_nodes = {lim.max_tree_nodes}",
                                  limit="max_tree_nodes")
        if req.check_last or d.q_dists is not None:
            raise InvalidArgument("a token tree takes neither check_last nor q_dists (its rule needs no q)")
        check_tree(d.tree_parents, d.draft_tokens)  # type: ignore[arg-type]
    elif k > lim.max_k:
        raise InvalidArgument(f"k = {k} exceeds the limit max_k = {lim.max_k}")
    if sampling_cfg is not None and sampling_cfg != session_cfg:
        raise InvalidArgument("sampling_cfg differs from the session's", session_sampling_cfg=session_cfg.to_dict())
    if req.ctx_len < 1:
        raise InvalidArgument(f"ctx_len = {req.ctx_len}: the context must hold at least one token")
    if len(req.append_ids) > req.ctx_len:
        raise InvalidArgument(f"len(append_ids) = {len(req.append_ids)} exceeds ctx_len = {req.ctx_len}")
    check_context_room(req.ctx_len, k, lim.max_context)
    if not HASH_RE.fullmatch(req.ctx_hash):
        raise InvalidArgument(f"ctx_hash {req.ctx_hash!r} is not 16 lower-case hex digits")
    if not 0 <= req.return_top_k <= lim.max_return_top_k:
        raise InvalidArgument(f"return_top_k = {req.return_top_k} is not in [0, {lim.max_return_top_k}]")
    if req.check_last and k == 0:
        raise InvalidArgument("check_last needs at least one draft token")
    if d.hard_mask and (len(d.hard_mask) != k or any(h not in (0, 1) for h in d.hard_mask)):
        raise InvalidArgument("hard_mask must have k entries, each 0 or 1")
    if len(req.request_id) > 128:
        raise InvalidArgument("request_id is longer than 128 characters")
    check_ids(req.append_ids, lim.vocab_size, "append_ids")
    q_dense = None
    if d.q_dists is not None:
        if len(d.q_dists) != k:
            raise InvalidArgument(f"len(q_dists) = {len(d.q_dists)} but k = {k}")
        for i, sd in enumerate(d.q_dists):
            if len(sd.ids) != len(sd.probs):
                raise InvalidArgument(f"q_dists[{i}]: {len(sd.ids)} ids but {len(sd.probs)} probs")
            if len(set(sd.ids)) != len(sd.ids):
                raise InvalidArgument(f"q_dists[{i}] repeats an id")
            check_ids(sd.ids, lim.vocab_size, f"q_dists[{i}].ids")
        q_dense = torch.stack([dense_from_sparse(sd.ids, sd.probs, lim.vocab_size) for sd in d.q_dists]) \
            if k else torch.zeros(0, lim.vocab_size, dtype=torch.float64)  # [k, vocab]
    check_draft(d.draft_tokens, d.q_token_probs, lim.vocab_size, d.draft_kind, q_dense)
    return q_dense


def fingerprint(req: VerifyRequest) -> str:
    """What a duplicate must share with the original to be answered from the replay cache: every
    field but request_id (repr of ints, floats and strings is exact)."""
    d = req.draft
    dists = None if d.q_dists is None else [(sd.ids, sd.probs) for sd in d.q_dists]
    body = (req.ctx_id, req.ctx_len, req.ctx_hash, req.append_ids, req.return_top_k, d.draft_tokens,
            d.q_token_probs, d.draft_kind, dists, d.hard_mask, req.check_last, d.tree_parents)
    return hashlib.sha256(repr(body).encode()).hexdigest()


def check_context(ctx: Context, req: VerifyRequest) -> int:
    """m = ctx_len - len(append_ids), the prefix kept; ContextMismatch when S[:m] + append_ids
    is not what the edge holds."""
    m = req.ctx_len - len(req.append_ids)
    expected = {"expected_ctx_len": len(ctx), "expected_ctx_hash": ctx.hash_at(len(ctx))}
    if m > len(ctx):
        raise ContextMismatch(f"the cloud holds {len(ctx)} tokens, the request needs {m} before append_ids; "
                              f"resend from {len(ctx)} or reopen", **expected)
    if ctx.hash_with(m, req.append_ids) != req.ctx_hash:
        raise ContextMismatch(f"ctx_hash disagrees with the cloud's S[:{m}] + append_ids; reopen with the "
                              "full context", **expected)
    return m


def _replay(session: Session, req: VerifyRequest, fp: str) -> VerifyResponse | None:
    """The cached answer, when this is a duplicate whose result the context still contains.

    A late duplicate of an already-applied round must not roll the session back (that would throw
    away later rounds); if the context no longer extends the cached answer, the round is recomputed
    (crop-then-append), which gives the same answer.
    """
    entry = session.replies.get(req.request_id) if req.request_id else None
    if entry is None or entry.fingerprint != fp:
        return None
    ctx, n = session.context, entry.response.ctx_len
    if len(ctx) >= n and ctx.hash_at(n) == entry.response.ctx_hash:
        return entry.answer()
    return None


@dataclass
class RoundPlan:
    # S' = S[:m] + append_ids, |S'| = ctx_len = L
    new: Context
    # positions of S' whose KV is kept: c = min(kv_len, m, L - 1) (>= 1 token of S' is fed to get p_1)
    num_cached_tokens: int
    # the forward this round needs: S'[c:] + y_1..y_k, logits of the last k + 1
    row: Row
    # what a duplicate must share with this request (replay cache)
    fp: str
    # positions of S' fed so far (a long append runs in prefill chunks before the verify row)
    fed: int = 0
    # the verify row as it ran (its kept positions' hidden states give the feature)
    row_run: Row | None = None
    # a tree round: the tree's parents (shared/tree.py)
    tree: list[int] | None = None

    def next_row(self, budget: int) -> Row:
        """The next forward of this round: a chunk of S' (num_logits = 0) while the rest does not fit in
        `budget` tokens, then the verify row S'[fed:] + y_1..y_k."""
        r = self.row
        fed = max(self.fed, self.num_cached_tokens)
        drafts = r.ids[len(self.new) - self.num_cached_tokens:]
        rest = list(self.new.ids[fed:])
        if len(rest) + len(drafts) > budget and len(rest) > 1:
            return Row(r.seq_id, fed, rest[: max(1, min(budget, len(rest) - 1))], num_logits=0)
        self.row_run = Row(r.seq_id, fed, rest + drafts, num_logits=r.num_logits, tree=r.tree, tree_base=r.tree_base)
        return self.row_run


def check_held(session: Session) -> int:
    """The session's sequence id; NotFound (404) once it was closed or evicted: before its round is planned, and
    again when the round's forward is done (a DELETE or shutdown may have come meanwhile; the seq_id goes
    back to the pool only after that forward's batch)."""
    seq_id = session.seq_id
    if session.closed or seq_id is None:
        raise NotFound(f"session {session.ctx_id!r} was closed or evicted; reopen it with the full context",
                       ctx_id=session.ctx_id)
    return seq_id


def plan_round(session: Session, req: VerifyRequest, fp: str) -> RoundPlan | VerifyResponse:
    """What the round needs from the model, or the cached answer of a duplicate. Reads, never writes."""
    seq_id = check_held(session)
    ctx = session.context
    m = check_context(ctx, req)
    cached = _replay(session, req, fp)
    if cached is not None:
        return cached
    L = req.ctx_len
    new = ctx.cut_and_extend(m, req.append_ids)
    c = min(session.kv_len, m, L - 1)
    fed = req.draft.draft_tokens[:-1] if req.check_last else req.draft.draft_tokens  # check_last: y_k is not run
    tree = req.draft.tree_parents
    # a tree's nodes are stored after S'; a tree of one branch (each node the child of the one before) runs as the
    # chain it is: its nodes sit at the offsets and positions a chain's would, and the chain's attention is cheaper
    # (1-3 % of a forward of 4-16 nodes on a CPU, `python -m bench.tree_cost`) for the same logits (the
    # batch-invariant kernels give a tree node the sums of its path run as a chain, shared/invariant.py); the
    # round is still verified and answered as the tree the edge sent
    row = Row(seq_id, c, list(new.ids[c:]) + fed, num_logits=len(fed) + 1,
              tree=None if tree is None or is_chain(tree) else tuple(tree), tree_base=L)
    return RoundPlan(new, c, row, fp, tree=tree)


def round_sampling(session: Session, req: VerifyRequest, plan: RoundPlan) -> RowSampling:
    """The processing of this round's kept logits: after S', then after each fed draft token."""
    d = req.draft
    fed = len(d.draft_tokens) - 1 if req.check_last else len(d.draft_tokens)  # drafts run through the target
    L = req.ctx_len
    if plan.tree is None:  # kept position i draws at L + i + 1 and scores draft i
        positions = [L + i + 1 for i in range(fed + 1)]
        scored = [(i, int(y)) for i, y in enumerate(d.draft_tokens[: fed + 1])]
    else:  # row 0 after S', row j + 1 after node j's path (drawn at L + depth(j) + 1); a node scored in its parent's
        positions = [L + 1] + [L + dep + 1 for dep in depths(plan.tree)]
        scored = [(par + 1, int(y)) for par, y in zip(plan.tree, d.draft_tokens, strict=True)]
    return RowSampling(session.sampling_cfg, plan.new.ids, d.draft_tokens[:fed], plan.tree, seed=session.seed,
                       positions=positions, scored=scored)


def finish_round(model: Runner, session: Session, req: VerifyRequest, q_dense: torch.Tensor | None,
                 plan: RoundPlan, logits: torch.Tensor, prefill_ms: float, replay_keep: int,
                 p: TargetProbs | torch.Tensor | None = None) -> RoundResult:
    """The verify rule on this round's logits ([fed + 1, vocab]), then the commit. `p` is their processed
    probabilities when the forward's rows were processed together (`round_sampling`). A raised error
    leaves context and counters as they were; the caller's abort() crops the KV back to `plan.num_cached_tokens`."""
    seq_id = check_held(session)  # closed while in the forward: 404, a chain or a tree alike
    d, L = req.draft, req.ctx_len
    fed = len(d.draft_tokens) - 1 if req.check_last else len(d.draft_tokens)  # drafts run through the target
    cfg = session.sampling_cfg
    if p is None:
        spec = round_sampling(session, req, plan)
        p = processed_probs(logits, cfg, spec.context_ids, spec.draft_ids, spec.parents)  # [fed + 1, vocab]
    out: VerifyOutcome | TreeOutcome
    if plan.tree is not None:  # walk the tree (shared/tree.py)
        assert plan.row_run is not None
        out = verify_tree(p, d.draft_tokens, plan.tree, d.q_token_probs, seed=session.seed, ctx_len=L,
                          greedy=cfg.greedy, correction=session.correction)
        path_tokens = [d.draft_tokens[j] for j in out.path]
        committed = path_tokens + [out.next_token]
        rows = [0] + [j + 1 for j in out.path]  # kept logit rows: after S', then after each accepted node
        resp, final = _answer(model, session, req, plan, logits, out, committed, rows, prefill_ms,
                              depth=max(depths(plan.tree), default=0), accepted_nodes=list(out.path))
        # The nodes' KV sits at storage offsets L + j, computed at positions L + depth(j) - 1: the path's nodes
        # move to offsets L .. L + la - 1 (their own positions), the rest is cropped. The next token has no KV yet,
        # nor has any position of the path the runner did not keep (the next round feeds them: S[kv_len:]).
        kv_len = L + model.keep_path(seq_id, L, out.path, path_tokens)  # the sequence is held until this batch ends
    else:
        out = verify_round(p, d.draft_tokens, d.q_token_probs, seed=session.seed, ctx_len=L, greedy=cfg.greedy,
                           correction=session.correction,  # type: ignore[arg-type]
                           draft_kind=d.draft_kind,  # type: ignore[arg-type]
                           q_dists=q_dense, check_last=req.check_last)
        la = out.accepted_len
        committed = d.draft_tokens[:la] + ([out.next_token] if out.next_token is not None else [])
        # kept logit rows: after S', then after each accepted draft (check_last, all kept: the last computed,
        # after y_1..y_{k-1})
        rows = list(range(min(la, fed) + 1))
        target = None
        if out.next_kind == "residual":
            assert out.target_ids is not None and out.target_probs is not None
            target = SparseDist(out.target_ids.tolist(), out.target_probs.tolist())
        resp, final = _answer(model, session, req, plan, logits, out, committed, rows, prefill_ms,
                              target_dist=target)
        kv_len = L + len(rows) - 1
        # KV stays valid for S' + y_1..y_La: the last accepted draft token's KV was filled in by this
        # forward (it was an input; with check_last y_k was not, so at most y_1..y_{k-1}). The correction/
        # bonus token has no KV yet; the next round feeds it as S[kv_len:]. For "residual", S ends at y_La
        # and the edge's token arrives as append_ids.
    _commit(model, session, req, plan, final, len(committed), kv_len, prefill_ms, replay_keep, resp)
    return RoundResult(resp, out)


def _answer(model: Runner, session: Session, req: VerifyRequest, plan: RoundPlan, logits: torch.Tensor,
            out: VerifyOutcome | TreeOutcome, committed: list[int], rows: list[int], prefill_ms: float,
            depth: int = 0, target_dist: SparseDist | None = None,
            accepted_nodes: list[int] | None = None) -> tuple[VerifyResponse, Context]:
    """The round's answer and its context S' + `committed`, a chain's or a tree's: `rows` are the kept logit rows
    of the committed positions (after S', then after each accepted draft), whose top ids and (for a session that
    asked) target states it carries; `depth` is a tree's (0: a chain)."""
    L, k, la = req.ctx_len, len(req.draft.draft_tokens), out.accepted_len
    final = plan.new.cut_and_extend(L, committed)
    top: list[list[int]] = []
    if req.return_top_k:
        top = logits[rows].topk(min(req.return_top_k, logits.size(-1)), dim=-1).indices.tolist()
    feature, states = None, None
    hidden = model.hidden_of(plan.row_run) if session.feature_encoding and plan.row_run is not None else None
    if hidden is not None and session.feature_window:  # every committed position's
        states = encode_states(hidden[rows], session.feature_encoding, L)
    elif hidden is not None:  # the state after S' + the accepted drafts, which decides the next token
        feature = encode_feature(hidden[rows[-1]], session.feature_encoding, L + len(rows) - 1)
    metrics = RoundMetrics(alpha_mean=sum(out.alphas) / k if k else 0.0, la_over_k=la / k if k else 0.0,
                           prefill_ms=prefill_ms, la_over_depth=la / depth if depth else 0.0)
    resp = VerifyResponse(accepted_len=la, correction=out.next_token, next_kind=out.next_kind,
                          target_dist=target_dist, ctx_len=len(final), ctx_hash=final.hash_at(len(final)),
                          top_k_ids=top, metrics=metrics, feature=feature, accepted_nodes=accepted_nodes,
                          states=states)
    return resp, final


def _commit(model: Runner, session: Session, req: VerifyRequest, plan: RoundPlan, final: Context,
            emitted: int, kv_len: int, prefill_ms: float, replay_keep: int, resp: VerifyResponse) -> None:
    """The round's commit, a chain's or a tree's: `final` is the context, its first `kv_len` positions' KV is
    valid, the counters count the round (`emitted` tokens) and the replay cache keeps its answer."""
    session.set_kv_len(model.pool, kv_len)
    session.context = final
    cnt = session.counters
    cnt.rounds += 1
    cnt.drafted += len(req.draft.draft_tokens)
    cnt.accepted += resp.accepted_len
    cnt.emitted += emitted
    cnt.prefill_ms += prefill_ms
    session.remember(req.request_id, plan.fp, resp, replay_keep)
