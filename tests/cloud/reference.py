"""Test-side models: a drafter that yields (y, q) like an edge would, and the reference round.

The reference recomputes a round from scratch: one full forward of the target over S + y
(no KV cache), the shared processing, the shared verify rule. The server must agree with it
exactly, so its cache handling (crop, append, invariants) is checked against a computation
that has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from shared.config import SamplingConfig
from shared.hashing import ctx_hash
from shared.rng import SAMPLE, position_uniform, sample_index
from shared.sampling import processed_probs
from shared.verify import VerifyOutcome, dense_from_sparse, sample_residual, verify_round

DRAFT_STREAM_SALT = 0x5EED  # draft draws use their own seed, apart from the verifier's coins


@dataclass
class Draft:
    # y_1..y_k
    tokens: list[int]
    # q_i = q(y_i | S, y_<i), processed
    q: list[float]
    # the whole processed q per position, [k, vocab] float32
    q_full: torch.Tensor

    def sparse(self) -> list[dict[str, list]]:
        """q_dists on the wire: the support of each row."""
        out = []
        for row in self.q_full:
            ids = torch.nonzero(row > 0).squeeze(-1)
            out.append({"ids": ids.tolist(), "probs": row[ids].double().tolist()})
        return out


class CausalLM:
    """A Hugging Face causal LM used without a cache: logits of the last `n` positions."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    @torch.inference_mode()
    def logits(self, ids: list[int], n: int) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long)  # [1, len]
        return self.model(input_ids=x).logits[0, -n:].float()  # [n, vocab]


class Drafter(CausalLM):
    def propose(self, ids: list[int], k: int, cfg: SamplingConfig, seed: int, deterministic: bool = False) -> Draft:
        """k draft tokens after `ids`, sampled from the processed q (or its argmax when deterministic)."""
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            q = processed_probs(self.logits(ids + tokens, 1), cfg, ids + tokens)[0]  # [vocab]
            if deterministic or cfg.greedy:
                y = int(q.argmax())
            else:
                y = sample_index(q, position_uniform(seed + DRAFT_STREAM_SALT, len(ids) + i + 1, SAMPLE))
            tokens.append(y)
            rows.append(q)
        full = torch.stack(rows) if rows else torch.zeros(0, 1)  # [k, vocab]
        qs = [1.0] * k if deterministic else [float(full[i, t]) for i, t in enumerate(tokens)]
        return Draft(tokens, qs, full)


def reference_round(target: CausalLM, context: list[int], draft: Draft, cfg: SamplingConfig, seed: int,
                    correction: str = "strict", draft_kind: str = "sampled",
                    with_q_dists: bool = False) -> VerifyOutcome:
    """The round recomputed without a cache: context is S' (after append_ids)."""
    k = len(draft.tokens)
    logits = target.logits(context + draft.tokens, k + 1)  # [k + 1, vocab]
    p = processed_probs(logits, cfg, context, draft.tokens)  # [k + 1, vocab]
    q_dists = None
    if with_q_dists:
        q_dists = torch.stack([dense_from_sparse(d["ids"], d["probs"], p.size(-1))
                               for d in draft.sparse()])  # [k, vocab]
    return verify_round(p, draft.tokens, draft.q, seed=seed, ctx_len=len(context), greedy=cfg.greedy,
                        correction=correction, draft_kind=draft_kind, q_dists=q_dists)  # type: ignore[arg-type]


class EdgeSim:
    """The edge's side of a session, as JSON bodies: draft, send, apply the answer.

    mode: "scalar" (q_token_probs only; a rejection may come back as "residual", drawn here),
    "q_dists" (sends the sparse q per position), "deterministic" (argmax drafts, q = 1).
    """

    def __init__(self, drafter: Drafter, prompt: list[int], cfg: SamplingConfig, seed: int,
                 mode: str = "scalar") -> None:
        self.drafter, self.cfg, self.seed, self.mode = drafter, cfg, seed, mode
        # S as the edge holds it (the tokens in `pending` included)
        self.ids = list(prompt)
        # the tail of S the cloud does not have yet (sent as append_ids)
        self.pending: list[int] = []
        self.rounds = 0

    def request(self, ctx_id: str, k: int) -> tuple[dict, Draft]:
        draft = self.drafter.propose(self.ids, k, self.cfg, self.seed, deterministic=self.mode == "deterministic")
        body = {"ctx_id": ctx_id, "ctx_len": len(self.ids), "ctx_hash": ctx_hash(self.ids),
                "append_ids": list(self.pending), "draft_tokens": draft.tokens, "q_token_probs": draft.q,
                "q_dists": draft.sparse() if self.mode == "q_dists" else None,
                "draft_kind": "deterministic" if self.mode == "deterministic" else "sampled",
                "k": k, "request_id": f"{ctx_id[:8]}-{self.rounds}"}
        return body, draft

    def apply(self, resp: dict, draft: Draft) -> None:
        la = resp["accepted_len"]
        base = len(self.ids)
        self.ids += draft.tokens[:la]
        assert resp["ctx_len"] == len(self.ids) + (resp["next_kind"] != "residual")
        if resp["next_kind"] == "residual":
            td = resp["target_dist"]
            tok = sample_residual(td["ids"], td["probs"], draft.q_full[la], self.seed, base + la + 1)
            assert resp["ctx_hash"] == ctx_hash(self.ids)
            self.ids.append(tok)
            self.pending = [tok]
        else:
            self.ids.append(resp["correction"])
            self.pending = []
            assert resp["ctx_hash"] == ctx_hash(self.ids)
        self.rounds += 1

    def reference(self, target: CausalLM, draft: Draft, correction: str) -> VerifyOutcome:
        return reference_round(target, self.ids, draft, self.cfg, self.seed, correction,
                               "deterministic" if self.mode == "deterministic" else "sampled",
                               with_q_dists=self.mode == "q_dists")


def assert_matches(resp: dict, ref: VerifyOutcome, ctx_len_before: int) -> None:
    """The server's answer equals the reference outcome (target_dist to float tolerance)."""
    assert resp["accepted_len"] == ref.accepted_len, (resp, ref)
    assert resp["next_kind"] == ref.next_kind
    assert resp["correction"] == ref.next_token
    if ref.next_kind == "residual":
        assert ref.target_ids is not None and ref.target_probs is not None
        assert resp["target_dist"]["ids"] == ref.target_ids.tolist()
        assert torch.allclose(torch.tensor(resp["target_dist"]["probs"], dtype=torch.float64), ref.target_probs,
                              atol=1e-5)
    else:
        assert resp["target_dist"] is None
    assert resp["ctx_len"] == ctx_len_before + ref.accepted_len + (ref.next_token is not None)


def run_rounds(client: Any, drafter: Drafter, target: CausalLM, prompt: list[int], cfg: SamplingConfig, seed: int,
               mode: str = "scalar", correction: str = "strict", rounds: int = 4, k: int = 4,
               until_kind: str | None = None, max_rounds: int = 20) -> tuple[str, EdgeSim, list[dict]]:
    """Open a session over `client` (tests.cloud.wire) and run rounds, each checked against the
    reference; with `until_kind`, keep going (up to max_rounds) until a round ends that way."""
    info = client.open({"prompt_ids": prompt, "sampling_cfg": cfg.to_dict(), "seed": seed, "correction": correction})
    assert (info["ctx_len"], info["ctx_hash"]) == (len(prompt), ctx_hash(prompt))
    edge = EdgeSim(drafter, prompt, cfg, seed, mode)
    answers: list[dict] = []
    while len(answers) < max_rounds:
        body, draft = edge.request(info["ctx_id"], k)
        ref = edge.reference(target, draft, correction)
        resp = client.verify(body)
        assert_matches(resp, ref, len(edge.ids))
        edge.apply(resp, draft)
        answers.append(resp)
        done = len(answers) >= rounds
        if done and (until_kind is None or any(a["next_kind"] == until_kind for a in answers)):
            break
    return info["ctx_id"], edge, answers
