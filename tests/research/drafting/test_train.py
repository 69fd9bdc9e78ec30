"""The training-time test: its mask, its batched unroll against drafting step by step, windows, the loop."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import research.drafting.train as train_mod
from research.drafting.evaluate import export
from research.drafting.train import TrainConfig, Windows, shift, train, trained_head, ttt_mask, unroll
from research.heads.attention_head import AttentionHead
from tests.research.drafting.conftest import HELDOUT_EVERY, WINDOW
from tests.research.drafting.test_attention_head import random_head, sequence


def test_ttt_mask_gives_step_j_the_real_keys_up_to_t_and_its_own_chain() -> None:
    pos = torch.tensor([[5, 6, 7, 8, 9, 10]])  # [1, T]
    window, t = 4, 6
    for j in (1, 2, 3):
        m = ttt_mask(pos, j, window)[0]  # [T, j * T]
        assert m.shape == (t, j * t)
        for c in range(t):  # chain c: its step-j query sits at position pos[c] + j - 1
            q = int(pos[0, c]) + j - 1
            for s in range(t):
                assert bool(m[c, s]) == (s <= c and q - int(pos[0, s]) < window)  # real keys
                for i in range(2, j + 1):
                    assert bool(m[c, (i - 1) * t + s]) == (s == c)  # step i's keys: its own chain only


@pytest.mark.parametrize(("window", "own"), [(64, False), (3, True)])
def test_batched_unroll_equals_drafting_each_chain_step_by_step(window: int, own: bool) -> None:
    head = random_head(window=window)
    s, x, p = sequence(b=1, t=9)
    k = 4
    preds = unroll(head, s, x, p, k, own_tokens=own)  # k x [1, T, d]
    for t in range(9 - k):
        real, ck, cv = head(s[:, :t + 1], x[:, :t + 1], p[:, :t + 1])  # the real pairs 0..t, cached
        g = real[:, -1:]  # [1, 1, d]
        torch.testing.assert_close(preds[0][:, t], g[:, 0], atol=1e-5, rtol=1e-5)
        for j in range(2, k + 1):
            tok = head.out_ids[head.logits(g).argmax(-1)] if own else x[:, t + j - 1:t + j]  # [1, 1]
            g, kk, vv = head(g, tok, p[:, t:t + 1] + j - 1, ck, cv)
            ck, cv = torch.cat([ck, kk], 2), torch.cat([cv, vv], 2)
            torch.testing.assert_close(preds[j - 1][:, t], g[:, 0], atol=1e-5, rtol=1e-5)


def test_shift_reads_j_positions_ahead_with_zeros_past_the_end() -> None:
    assert shift(torch.tensor([[1, 2, 3, 4]]), 2).tolist() == [[3, 4, 0, 0]]


def test_windows_align_states_tokens_and_positions() -> None:
    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.arange(100, 130, dtype=torch.int32), "prompt_len": 12, "start": 4,
             "states": torch.arange(4, 29).repeat_interleave(3).view(25, 3).half()},  # state t holds t
            {"ids": torch.arange(200, 210, dtype=torch.int32), "prompt_len": 3, "start": 0,
             "states": torch.arange(0, 9).repeat_interleave(3).view(9, 3).half()}]
    bt = Windows(rows, seq=12).batch(16, g)
    for b in range(16):
        n = int(bt["valid"][b].sum())
        t = bt["P"][b, :n]
        torch.testing.assert_close(bt["S"][b, :n, 0], t.float())  # the state of position t
        base = 100 if n == 12 and int(bt["X"][b, 0]) >= 100 else 200
        assert bt["X"][b, :n].tolist() == (base + t + 1).tolist()  # x_{t+1}
        plen = 12 if base == 100 else 3
        assert bt["scored"][b].tolist() == ((t + 1 >= plen).tolist() + [False] * (12 - n))
        assert bt["P"][b].tolist() == list(range(int(t[0]), int(t[0]) + 12))  # pads go on counting


def tiny_config(work: Path, data: Path, target: Path, steps: int) -> TrainConfig:
    return TrainConfig(work=str(work), data=str(data), target=str(target), heldout_every=HELDOUT_EVERY,
                       n_out=512, embed_dim=16, width=32, heads=2, kv_heads=1, head_dim=16, ffn_size=64,
                       window=WINDOW, steps=steps, batch=4, seq=16, unroll=3, lr=1e-2, warmup=5, log_every=1,
                       threads=1, eval_k=4)


@pytest.fixture(scope="module")
def trained(tiny_work: Path, tiny_data: Path, tiny_target: Path,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, dict]:
    work = tmp_path_factory.mktemp("train")
    shutil.copytree(tiny_work / "states", work / "states")
    cfg = tiny_config(work, tiny_data, tiny_target, steps=60)
    return cfg, train(cfg, "train --steps 60")


def test_training_loss_falls_on_a_tiny_target(trained: tuple[TrainConfig, dict]) -> None:
    losses = [e["loss"] for e in trained[1]["log"]]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    assert trained[1]["shards"] == [1, 2] and trained[1]["answer_tokens"] > 0


def test_a_run_stopped_by_sigterm_resumes_to_the_same_weights(trained: tuple[TrainConfig, dict],
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = trained[0]
    shutil.copytree(Path(cfg.work) / "states", tmp_path / "states")
    cfg2 = tiny_config(tmp_path, Path(cfg.data), Path(cfg.target), steps=60)
    real_loss, calls = train_mod.ttt_loss, []

    def stopping_loss(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 25:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop finishes this step, checkpoints, stops
        return real_loss(*a, **kw)

    monkeypatch.setattr(train_mod, "ttt_loss", stopping_loss)
    assert train(cfg2, "first")["step"] == 25
    monkeypatch.setattr(train_mod, "ttt_loss", real_loss)
    state = train(cfg2, "second")
    assert state["step"] == 60 and [c["from_step"] for c in state["commands"]] == [0, 25]
    a, b = trained_head(cfg)[0], trained_head(cfg2)[0]
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, msg=name)


def test_export_writes_the_head_its_report_and_its_record(trained: tuple[TrainConfig, dict], tmp_path: Path) -> None:
    import json
    report = export(trained[0], tmp_path / "head", "export --out head")
    out = tmp_path / "head"
    head = AttentionHead.load(out)
    assert head.cfg.window == WINDOW and head.cfg.n_out == 512
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    assert report["heldout_shards"] == [0] and report["heldout_greedy"]["rows"] == 6
    assert len(report["heldout_greedy"]["by_position"]) == 4
    record = json.loads((out / "training.json").read_text())
    assert record["export_command"] == "export --out head" and record["train_commands"][0]["command"] == "train --steps 60"
    assert record["steps"] == 60 and record["data"]["train_shards"] == [1, 2] and len(record["log"]) == 60
