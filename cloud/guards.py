"""Checks that run before a request is converted or queued, the same for REST and gRPC.

They read only the raw message (its header, list lengths), never the items, so a hostile message
is refused at a cost that does not grow with its size: the bearer rule, the counts of a verify
round, and the context rule (a round may not take the committed context past the model's).
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.errors import InvalidArgument

# `reason` of the 422 answered to a round when the committed context has no room left
CONTEXT_FULL = "context_full"


def bearer_key(authorization: str | None) -> str | None:
    """The key of `Authorization: Bearer KEY`; None for a missing header or any other scheme."""
    scheme, _, key = (authorization or "").partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None


def check_verify_counts(*, declared_k: int, n_draft: int, n_q: int, n_dists: int | None, n_hard: int,
                        n_append: int, max_k: int, max_context: int, n_parents: int | None = None,
                        max_tree_nodes: int = 0) -> None:
    """InvalidArgument unless the lists of a verify round have the lengths k and the limits allow.

    n_dists: len(q_dists), None when q_dists is not sent; n_hard: len(hard_mask), 0 when not sent;
    n_parents: len(tree_parents), None for a chain.
    """
    if declared_k != n_draft:
        raise InvalidArgument(f"k = {declared_k} but len(draft_tokens) = {n_draft}")
    if n_parents is not None:
        if n_parents != n_draft:
            raise InvalidArgument(f"len(tree_parents) = {n_parents} but k = {n_draft}")
        if n_draft > max_tree_nodes:
            raise InvalidArgument(f"a tree of {n_draft} nodes exceeds the limit max_tree_nodes = {max_tree_nodes}",
                                  limit="max_tree_nodes")
    elif n_draft > max_k:
        raise InvalidArgument(f"k = {n_draft} exceeds the limit max_k = {max_k}", limit="max_k")
    if n_q != n_draft:
        raise InvalidArgument(f"len(q_token_probs) = {n_q} but k = {n_draft}")
    if n_dists is not None and n_dists != n_draft:
        raise InvalidArgument(f"len(q_dists) = {n_dists} but k = {n_draft}")
    if n_hard and n_hard != n_draft:
        raise InvalidArgument("hard_mask must have k entries, each 0 or 1")
    if n_append > max_context:
        raise InvalidArgument(f"len(append_ids) = {n_append} exceeds the model's context ({max_context})")


def check_dist_sizes(sizes: Iterable[tuple[int, int]], vocab_size: int) -> None:
    """(len(ids), len(probs)) of each q_dists entry (at most max_k of them, counts checked first)."""
    for i, (n_ids, n_probs) in enumerate(sizes):
        if max(n_ids, n_probs) > vocab_size:
            raise InvalidArgument(f"q_dists[{i}] has more entries than the vocabulary ({vocab_size})")


def check_context_room(ctx_len: int, k: int, max_context: int) -> None:
    """A round commits up to k + 1 tokens (the drafts and the correction / bonus) after ctx_len,
    so it needs ctx_len + k + 1 <= max_context. /v1/generate stops at the same length."""
    room = max_context - ctx_len - 1  # the largest k this context still takes
    if room < 0:
        raise InvalidArgument(f"the context is full: ctx_len = {ctx_len} of the model's {max_context} positions; "
                              "the generation ends here", reason=CONTEXT_FULL, max_context=max_context)
    if k > room:
        raise InvalidArgument(f"ctx_len + k + 1 = {ctx_len + k + 1} exceeds the model's context ({max_context}): "
                              f"at most k = {room} fits", reason="k_over_room", max_context=max_context, max_k_here=room)
