"""Greedy speculative decoding against the real cloud process equals target-only greedy decoding.

For 20 prompts, the text of the model drafter (token trees, the default, and chains; in PyTorch and on
llama.cpp from a GGUF file) and of the n-gram drafter (REST; a few over gRPC) must equal the cloud's own target-only greedy output (POST /v1/generate) token for token. Should a
float near-tie ever flip an argmax between the batched verify forward and one-token decoding, the
test accepts the divergence only where it shows the two candidates' processed target logits are
within TIE_TOL of each other, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from edge.client import EdgeClient
from edge.drafters import ModelDrafter, NGramDrafter
from edge.settings import EdgeSettings
from shared.config import SamplingConfig
from shared.sampling import presence_mask
from tests.server import CloudProcess

N_NEW = 20
TIE_TOL = 1e-4
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "import os\nimport sys\n\n\ndef main():\n    args = sys.argv[1:]\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "with open(path) as f:\n    for line in f:\n        line = line.strip()\n",
    "try:\n    value = int(text)\nexcept ValueError:\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "result = {key: value for key, value in pairs if value is not None}\n",
    "    def __repr__(self):\n        return f\"{type(self).__name__}(",
    "# Copyright the authors. All rights reserved.\n\"\"\"Utilities for",
    "The lighthouse keeper had not spoken to another person in eleven days. Each morning he",
    "To bake a simple loaf of bread, you need only flour, water, salt and yeast.",
    "The river that runs through the old town has changed its course three times.",
    "Thank you all for coming to this morning's meeting. Before we discuss the budget,",
    "Most vegetables grow best in full sun, in soil that drains well and",
    "Dear Margaret, I hope this letter finds you well. Since you left the village,",
    "The committee met on a cold Tuesday morning to decide the future of the old library.",
    "She opened the window and listened to the rain falling on the roofs of the city.",
    "In the beginning there was only the sea, and the sea was",
    "a b c a b c a b c a b c",
]


@pytest.fixture(scope="module")
def cloud(tiny_cloud_server: CloudProcess) -> CloudProcess:
    """The session's shared tiny cloud (tests/e2e/conftest.py): this module reads texts and answers only."""
    return tiny_cloud_server


@pytest.fixture(scope="module")
def target(tiny_pair: tuple[Path, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()


def settings(cloud: CloudProcess, transport: str, **kw: Any) -> EdgeSettings:
    where = {"cloud_url": cloud.http_url} if transport == "rest" else {"grpc_target": cloud.grpc_target}
    values: dict[str, Any] = {"temperature": 0, "repetition_penalty": 1.1, "max_new_tokens": N_NEW,
                              "timeout_ms": 10_000, "timeout_fallback": False, **where, **kw}
    return EdgeSettings(**values)


def assert_equal_or_tie(spec: list[int], ref: list[int], prompt_ids: list[int], target: Any,
                        cfg: SamplingConfig) -> None:
    """spec == ref, or they part at a position where the target's two candidates are tied."""
    if spec == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b)
    ctx = prompt_ids + ref[:i]
    with torch.no_grad():
        logits = target.double()(input_ids=torch.tensor([ctx])).logits[0, -1]  # [vocab]
    target.float()
    seen = presence_mask(ctx, [], logits.numel())[0]  # [vocab]
    r = cfg.repetition_penalty
    x = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)  # [vocab]
    gap = abs(float(x[spec[i]] - x[ref[i]]))
    assert gap < TIE_TOL, f"outputs part at token {i}: {spec[i]} vs {ref[i]}, logit gap {gap:.2e} is no tie"
    print(f"outputs part at token {i} on a float tie (processed logit gap {gap:.2e})")


@pytest.mark.parametrize("kind", ["model", "model-chain", "gguf", "gguf-chain", "ngram"])
def test_greedy_speculative_equals_target_greedy_for_20_prompts(cloud: CloudProcess, tokenizer: Any, target: Any,
                                                                drafter: ModelDrafter, gguf_drafter: Any,
                                                                kind: str) -> None:
    # every prompt's text through verify rounds (speculate-or-stream would stream where the tiny draft, as dear as
    # its target, cannot pay)
    s = settings(cloud, "rest", tree="off" if kind.endswith("-chain") else "auto", stream_switch=False)
    reference = EdgeClient(s.model_copy(update={"mode": "cloud_only"}), tokenizer=tokenizer)
    accepted = 0
    for prompt in PROMPTS:
        d = drafter if kind.startswith("model") else gguf_drafter if kind.startswith("gguf") else NGramDrafter(order=4)
        spec = EdgeClient(s, drafter=d, tokenizer=tokenizer).generate(prompt)
        assert (spec.metrics.tree_rounds > 0) == (kind in ("model", "gguf"))
        ref = reference.generate(prompt)
        assert len(ref.token_ids) == N_NEW
        assert_equal_or_tie(spec.token_ids, ref.token_ids, spec.prompt_ids, target, s.sampling())
        assert spec.metrics.local_commits == 0 and spec.metrics.verify_calls >= 1
        m = spec.metrics  # every round ran at least its fed context token and its drafts through the target
        assert m.target_rows >= m.verify_calls + m.drafted and m.target_forwards == m.verify_calls + m.streamed
        accepted += spec.metrics.accepted
    assert accepted > 0  # drafts were accepted (the repetitive prompt at least, for the n-gram)


@pytest.mark.parametrize("kind", ["model", "model-tree", "ngram"])
def test_greedy_over_grpc_equals_rest(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter, kind: str) -> None:
    for prompt in PROMPTS[:2] + PROMPTS[-1:]:
        outs = []
        for transport in ("rest", "grpc"):
            d = drafter if kind != "ngram" else NGramDrafter(order=4, filler_top_k=2)
            # the round structure is compared too: k (or the tree) must not depend on the transports' timings
            # (speculate-or-stream does, by design: it is off here)
            shape = {"tree": "12"} if kind == "model-tree" else {"tree": "off", "k_policy": "dynamic"}
            shape["stream_switch"] = False
            shape["node_budget"] = False  # the cloud's budget follows its load, which the timings move
            outs.append(EdgeClient(settings(cloud, transport, **shape), drafter=d,
                                   tokenizer=tokenizer).generate(prompt))
        assert outs[0].token_ids == outs[1].token_ids
        assert [r.accepted_len for r in outs[0].rounds] == [r.accepted_len for r in outs[1].rounds]
        assert outs[1].metrics.bytes_up < outs[0].metrics.bytes_up  # protobuf is smaller than JSON


def test_ngram_filler_asks_for_and_uses_target_top_ids(cloud: CloudProcess, tokenizer: Any) -> None:
    d = NGramDrafter(order=3, filler_top_k=3)
    r = EdgeClient(settings(cloud, "rest"), drafter=d, tokenizer=tokenizer).generate(PROMPTS[2])
    # every checked position fed the storage with the target's top-3: its counts hold filler weights
    weights = [w for ctx in d.storage._counts[0].values() for w in ctx.values()]
    assert any(w % 1 for w in weights)  # fractional = filler observations
    assert r.metrics.local_commits == 0


def cli_args(cloud: CloudProcess, tiny_pair: tuple[Path, Path], *extra: str) -> list[str]:
    return ["generate", PROMPTS[0], "--cloud", cloud.http_url, "--draft", str(tiny_pair[1]), "--tokenizer",
            str(tiny_pair[0]), "--temperature", "0", "--max-new-tokens", "12", "--timeout-ms", "10000",
            "--no-timeout-fallback", *extra]


def test_cli_json_equals_the_api_and_logs_every_round(cloud: CloudProcess, tiny_pair: tuple[Path, Path],
                                                      tokenizer: Any, drafter: ModelDrafter, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from edge.cli import main
    from edge.report import LOG_FIELDS

    log = tmp_path / "rounds.jsonl"
    assert main(cli_args(cloud, tiny_pair, "--json", "--log", str(log))) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "prompt_ids", "rounds", "metrics"} <= set(out)
    api = EdgeClient(settings(cloud, "rest", max_new_tokens=12), drafter=drafter, tokenizer=tokenizer)
    ref = api.generate(PROMPTS[0])
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text and out["prompt_ids"] == ref.prompt_ids
    assert all({"k", "accepted_len", "next_kind"} <= set(r) for r in out["rounds"])
    assert out["metrics"]["emitted"] == 12 and out["metrics"]["cloud_calls"] >= len(out["rounds"])
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == len(out["rounds"]) and all(set(LOG_FIELDS) == set(line) for line in lines)


def test_cli_modes_and_plain_streaming(cloud: CloudProcess, tiny_pair: tuple[Path, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from edge.cli import main

    texts = {}
    for mode in ("cloud_only", "edge_only"):
        assert main(cli_args(cloud, tiny_pair, "--mode", mode, "--json")) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["mode"] == mode and len(out["token_ids"]) == 12
        texts[mode] = out["text"]
    assert main(cli_args(cloud, tiny_pair)) == 0  # not a terminal: plain text, then the summary on stderr
    captured = capsys.readouterr()
    assert captured.out == texts["cloud_only"] + "\n" and "\x1b[" not in captured.out
    assert "acceptance rate" in captured.err and "tokens per cloud call" in captured.err


def test_cli_reports_errors_with_an_exit_code(cloud: CloudProcess, tiny_pair: tuple[Path, Path],
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.cli import main
    from tests.server import free_port

    assert main(cli_args(cloud, tiny_pair, "--top-p", "1.5")) == 2
    assert "bad settings" in capsys.readouterr().err
    monkeypatch.setenv("SPECSPLIT_EDGE_MAX_RETRIES", "1")
    args = cli_args(cloud, tiny_pair)
    args[args.index("--cloud") + 1] = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    assert main(args) == 1
    assert "unavailable" in capsys.readouterr().err


def test_console_script_over_grpc_with_the_ngram_drafter(cloud: CloudProcess, tiny_pair: tuple[Path, Path]) -> None:
    import json
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "specsplit-edge"
    args = cli_args(cloud, tiny_pair, "--grpc", cloud.grpc_target, "--json", "--threads", "1")
    args[args.index("--draft") + 1] = "ngram"
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert len(out["token_ids"]) == 12 and out["metrics"]["by_origin"]["local"] == 0
