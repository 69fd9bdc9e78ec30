"""Token-tree rounds on the verifier (REST, in process, the tiny pair).

Greedy: every round's tree holds the target's next token as a second or third child, under decoys that
share no token with it, and decoy subtrees under the wrong branches; the text after many rounds equals
the target's own greedy text (from a cache-free reference forward), so the kept path's KV (moved to its
positions, the other nodes' freed) serves every later round. Also: a sampled session's tree rounds give
the text `/v1/generate` gives with the same seed (the rule draws what target-only decoding draws), a
malformed tree is refused with 422 and leaves the session as it was, and the blocks of rejected nodes go
back to the pool.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fastapi.testclient import TestClient

from shared.config import SamplingConfig
from shared.hashing import ctx_hash
from tests.cloud.reference import CausalLM

PROMPT = [11, 305, 23, 977, 42, 8, 1500, 61]


def greedy_text(target: CausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target.logits(ids, 1)[0].argmax()))
    return ids[len(prompt):]


def decoys(avoid: set[int], n: int, start: int) -> list[int]:
    out, t = [], start
    while len(out) < n:
        if t not in avoid:
            out.append(t)
        t += 1
    return out


def tree_round(c: TestClient, sid: str, S: list[int], cloud_len: int, truth: list[int],
               rank: int) -> dict:
    """A tree whose root has 3 children with truth[0] at `rank`, under it 3 children with truth[1] at the
    next rank, under that truth[2] alone; each decoy gets one child of its own."""
    tokens: list[int] = []
    parents: list[int] = []
    node = -1
    for depth, want in enumerate(truth[:3]):
        width = 1 if depth == 2 else 3
        r = (rank + depth) % width
        others = decoys(set(truth), width - 1, 1000 + 37 * len(tokens))
        level = others[:r] + [want] + others[r:]
        firsts = []
        for t in level:
            tokens.append(t)
            parents.append(node)
            firsts.append(len(tokens) - 1)
        for j in firsts:
            if tokens[j] != want:  # a decoy subtree
                tokens.append(decoys(set(truth), 1, 3000 + j)[0])
                parents.append(j)
        node = firsts[level.index(want)]
    body = {"ctx_id": sid, "ctx_len": len(S), "ctx_hash": ctx_hash(S), "append_ids": S[cloud_len:],
            "draft_tokens": tokens, "q_token_probs": [0.5] * len(tokens), "k": len(tokens),
            "tree_parents": parents}
    r = c.post("/v1/verify", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [tokens[j] for j in out["accepted_nodes"]] == truth[: out["accepted_len"]]
    return out


def test_greedy_tree_rounds_give_the_targets_text(client: Callable[..., TestClient],
                                                  tiny_reference: CausalLM) -> None:
    c = client()
    n = 24
    truth = greedy_text(tiny_reference, PROMPT, n + 4)
    r = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0}})
    sid = r.json()["ctx_id"]
    S, cloud_len, rank, rounds = list(PROMPT), len(PROMPT), 0, 0
    while len(S) - len(PROMPT) < n:
        done = len(S) - len(PROMPT)
        out = tree_round(c, sid, S, cloud_len, truth[done:done + 3], rank)
        assert out["accepted_len"] == 3 and out["next_kind"] == "bonus"
        S += truth[done:done + 4]
        assert out["correction"] == truth[done + 3] and out["ctx_len"] == len(S)
        cloud_len, rank, rounds = len(S), rank + 1, rounds + 1
    assert S[len(PROMPT):] == truth[: len(S) - len(PROMPT)]
    info = c.get(f"/v1/sessions/{sid}").json()
    assert info["ctx_len"] == len(S) and info["counters"]["accepted"] == 3 * rounds


def test_a_tree_that_misses_gets_the_targets_correction(client: Callable[..., TestClient],
                                                        tiny_reference: CausalLM) -> None:
    c = client()
    truth = greedy_text(tiny_reference, PROMPT, 3)
    sid = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0}}).json()["ctx_id"]
    wrong = decoys(set(truth), 3, 2000)
    body = {"ctx_id": sid, "ctx_len": len(PROMPT), "ctx_hash": ctx_hash(PROMPT), "append_ids": [],
            "draft_tokens": [truth[0], wrong[0], wrong[1], wrong[2]], "q_token_probs": [0.4] * 4, "k": 4,
            "tree_parents": [-1, -1, 0, 0]}
    out = c.post("/v1/verify", json=body).json()
    assert out["accepted_nodes"] == [0] and out["next_kind"] == "correction" and out["correction"] == truth[1]


def test_sampled_tree_rounds_give_the_seeded_generate_text(client: Callable[..., TestClient],
                                                           tiny_reference: CausalLM) -> None:
    """Any tree, any acceptance: the committed text is `/v1/generate`'s for the same seed and settings."""
    c = client()
    cfg = {"temperature": 0.8, "top_p": 0.95}
    want = c.post("/v1/generate", json={"prompt_ids": PROMPT, "sampling_cfg": cfg, "seed": 5,
                                        "max_new_tokens": 20, "stop_at_eos": False}).json()["token_ids"]
    sid = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": cfg, "seed": 5}).json()["ctx_id"]
    S, cloud_len = list(PROMPT), len(PROMPT)
    g = torch.Generator().manual_seed(0)
    while len(S) - len(PROMPT) < 20:
        probs = torch.softmax(tiny_reference.logits(S, 1)[0], -1)
        top = probs.topk(3).indices.tolist()
        rand = torch.randint(5, 4000, (2,), generator=g).tolist()
        sub = [t for t in rand if t not in top][:1]
        body = {"ctx_id": sid, "ctx_len": len(S), "ctx_hash": ctx_hash(S), "append_ids": S[cloud_len:],
                "draft_tokens": top + sub, "q_token_probs": [0.3] * (len(top) + len(sub)),
                "k": len(top) + len(sub), "tree_parents": [-1, -1, -1] + [0] * len(sub)}
        out = c.post("/v1/verify", json=body).json()
        S += [body["draft_tokens"][j] for j in out["accepted_nodes"]] + [out["correction"]]
        cloud_len = out["ctx_len"]
    assert S[len(PROMPT):len(PROMPT) + 20] == want[:20]


def test_malformed_trees_are_refused_and_change_nothing(client: Callable[..., TestClient]) -> None:
    c = client(max_tree_nodes=8)
    assert c.get("/v1/model").json()["max_tree_nodes"] == 8
    sid = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0}}).json()["ctx_id"]

    def state() -> dict:
        info = c.get(f"/v1/sessions/{sid}").json()
        for clock in ("idle_s", "age_s"):
            info["counters"].pop(clock)
        return info

    before = state()
    base = {"ctx_id": sid, "ctx_len": len(PROMPT), "ctx_hash": ctx_hash(PROMPT), "append_ids": []}
    bad = [
        ({"draft_tokens": [5, 6], "q_token_probs": [0.5, 0.5], "k": 2, "tree_parents": [-1, 1]}, "earlier node"),
        ({"draft_tokens": [5, 5], "q_token_probs": [0.5, 0.5], "k": 2, "tree_parents": [-1, -1]}, "sibling"),
        ({"draft_tokens": [5, 6], "q_token_probs": [0.5, 0.5], "k": 2, "tree_parents": [-1]}, "tree_parents"),
        ({"draft_tokens": list(range(5, 14)), "q_token_probs": [0.5] * 9, "k": 9, "tree_parents": [-1] * 9},
         "max_tree_nodes"),
        ({"draft_tokens": [5, 6], "q_token_probs": [0.5, 0.5], "k": 2, "tree_parents": [-1, 0],
          "check_last": True}, "check_last"),
    ]
    for extra, words in bad:
        r = c.post("/v1/verify", json={**base, **extra})
        assert r.status_code == 422 and words in r.json()["error"]["message"], (words, r.text)
    assert state() == before


def test_rejected_nodes_give_their_blocks_back(make_service: Callable[..., object]) -> None:
    """After tree rounds with wide rejected subtrees, the session holds blocks for its context only."""
    from cloud.rest import create_app
    svc = make_service(kv_block_size=4, prefix_cache=False)
    c = TestClient(create_app(svc))  # type: ignore[arg-type]
    cfg = SamplingConfig(temperature=0)
    sid = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": cfg.to_dict()}).json()["ctx_id"]
    S, cloud_len = list(PROMPT), len(PROMPT)
    for _ in range(4):
        toks = list(range(100, 124))  # 24 nodes of decoys: at most a lucky one is kept
        body = {"ctx_id": sid, "ctx_len": len(S), "ctx_hash": ctx_hash(S), "append_ids": S[cloud_len:],
                "draft_tokens": toks, "q_token_probs": [0.5] * 24, "k": 24, "tree_parents": [-1] * 8 + list(range(16))}
        out = c.post("/v1/verify", json=body).json()
        S += [toks[j] for j in out["accepted_nodes"]] + [out["correction"]]
        cloud_len = out["ctx_len"]
    pool = svc.model.pool  # type: ignore[attr-defined]
    pool.manager.check()
    kv_len = len(S) - 1  # the last committed token has no KV yet
    assert pool.manager.used == -(-kv_len // 4)


def test_a_one_branch_tree_runs_as_a_chain(make_service: Callable[..., object], tiny_reference: CausalLM,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree whose every node is the child of the one before is forwarded as a chain row (no tree in the row the
    model runs), is answered as the tree it was (accepted_nodes, depth), and commits what the same drafts sent
    as a chain commit. The swap is exact because a chain-shaped tree row and a chain row give bitwise equal
    logits on the batch-invariant runner (checked here on the tiny target directly); without the swap the spy
    sees the tree."""
    from cloud.rest import create_app
    from shared.kvpool import Row

    svc = make_service()
    model = svc.model  # type: ignore[attr-defined]
    seen: list[tuple[int, ...] | None] = []
    forward = model.forward

    def spy(rows: list[Row]) -> list[torch.Tensor]:
        seen.extend(r.tree for r in rows if r.num_logits > 1)
        return forward(rows)

    monkeypatch.setattr(model, "forward", spy)  # undone after the test (the model is the session's fixture)
    c = TestClient(create_app(svc))  # type: ignore[arg-type]
    truth = greedy_text(tiny_reference, PROMPT, 6)
    drafts = truth[:3] + [decoys(set(truth), 1, 500)[0]]  # three kept, the fourth rejected
    answers = []
    for tree in (True, False):
        sid = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0}}).json()["ctx_id"]
        body = {"ctx_id": sid, "ctx_len": len(PROMPT), "ctx_hash": ctx_hash(PROMPT), "append_ids": [],
                "draft_tokens": drafts, "q_token_probs": [0.5] * 4, "k": 4,
                **({"tree_parents": [-1, 0, 1, 2]} if tree else {})}
        answers.append(c.post("/v1/verify", json=body).json())
    monkeypatch.undo()
    assert seen == [None, None], seen
    as_tree, as_chain = answers
    assert as_tree["accepted_nodes"] == [0, 1, 2] and as_tree["accepted_len"] == as_chain["accepted_len"] == 3
    assert as_tree["correction"] == as_chain["correction"] == truth[3]

    s = model.pool.allocate()  # the equality the swap rests on, on the same runner
    ids = PROMPT + drafts
    outs = []
    for tree in ((-1, 0, 1, 2), None):
        model.forward([Row(s, 0, PROMPT[:-1], 0)])
        outs.append(model.forward([Row(s, len(PROMPT) - 1, ids[len(PROMPT) - 1:], 5, tree=tree,
                                       tree_base=len(PROMPT))])[0])
        model.pool.crop(s, 0)
    model.pool.release(s)
    assert torch.equal(outs[0], outs[1])
