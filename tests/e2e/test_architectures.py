"""Real architectures as target and as draft, over REST against the real server process.

For each attention architecture (Llama with GQA, Qwen3, Mistral with a sliding window, Gemma3 with
sliding and global layers, Phi3, GPT-NeoX; GPT-2 is the demo pair's, and tests/shared/test_kvpool.py
covers Gemma2 in process) a tiny random target is served
by `specsplit-cloud`, and its draft is a noisy copy of the same architecture, so drafts are
partly accepted: rounds reject inside the draft and both sides crop their KV. Greedy speculative
output must equal greedy decoding of the target without any cache, over a context (prompt +
generated) several times longer than the sliding window (8). Models whose layers keep
recurrent or convolution state are refused at start-up with one line and exit code 2.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.cloud_proc import cloud_command
from edge.client import EdgeClient
from edge.settings import EdgeSettings
from shared.hf_model import load_causal_lm
from shared.kvpool import UnsupportedModel
from tests.server import CloudProcess
from tests.tiny_models import RECURRENT, SERVED, WINDOW, build

PROMPT = "def fibonacci(n):\n    if n < 2:"
NEW_TOKENS = 28


def noisy_copy(target: Path, out: Path, scale: float = 0.25, seed: int = 1) -> Path:
    """The target with Gaussian noise (relative `scale`) on every weight matrix: a draft that agrees
    with it often but not always."""
    model = AutoModelForCausalLM.from_pretrained(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    model.save_pretrained(out)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def greedy_reference(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with no cache at all: one full forward per token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("arch")


@pytest.mark.parametrize("arch", SERVED)
def test_greedy_speculative_equals_target_greedy(arch: str, models: Path) -> None:
    target = build(arch, models / f"{arch}-target")
    draft = noisy_copy(target, models / f"{arch}-draft")
    with CloudProcess(target) as cloud:
        settings = EdgeSettings(cloud_url=cloud.http_url, draft=str(draft), temperature=0.0, top_p=1.0,
                                repetition_penalty=1.0, fixed_k=4, max_new_tokens=NEW_TOKENS, stop_at_eos=False,
                                timeout_fallback=False, stream_switch=False)  # rounds, never a stream
        client = EdgeClient(settings)
        try:
            result = client.generate(PROMPT)
        finally:
            client.close()
    expected = greedy_reference(target, result.prompt_ids, NEW_TOKENS)
    assert result.token_ids == expected
    assert len(result.prompt_ids) + NEW_TOKENS > 3 * WINDOW
    accepted = [r.accepted_len for r in result.rounds]
    # partial acceptance: some rounds keep drafts, some reject inside the draft (both sides crop)
    assert any(0 < a for a in accepted) and any(a < 4 for a in accepted), accepted


@pytest.mark.parametrize("arch", RECURRENT)
def test_recurrent_models_are_refused_with_one_line(arch: str, models: Path) -> None:
    d = build(arch, models / arch)
    with pytest.raises(UnsupportedModel) as e:
        load_causal_lm(d, "cpu", torch.float32)
    assert "\n" not in str(e.value) and "rolled back" in str(e.value)


def test_cloud_refuses_a_recurrent_target_at_start(models: Path) -> None:
    d = build("mamba", models / "mamba-cli")
    proc = subprocess.run([*cloud_command(), "--model", str(d), "--http-port", "0", "--grpc-port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("specsplit-cloud:")]
    assert len(lines) == 1 and "mamba" in lines[0] and "Traceback" not in proc.stderr


def test_edge_refuses_a_hybrid_draft_at_start(models: Path) -> None:
    d = build("jamba", models / "jamba-cli")
    edge = Path(sys.executable).parent / "specsplit-edge"
    proc = subprocess.run([str(edge), "generate", "x", "--draft", str(d), "--cloud", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("specsplit-edge: cannot start:") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_executor_keeps_greedy_exactness(arch: str, models: Path) -> None:
    """The cloud on its own forward (cloud/runners/graphs.py, --executor eager: the CUDA-graph path's code,
    eagerly on the CPU): greedy speculative text, chains and the edge's token trees, equals greedy decoding of
    the target without any cache."""
    target = build(arch, models / f"{arch}-graph-target", seed=2)
    draft = noisy_copy(target, models / f"{arch}-graph-draft")
    with CloudProcess(target, extra_args=("--executor", "eager")) as cloud:
        import httpx

        assert httpx.get(cloud.http_url + "/v1/model").json()["forward_path"] == "paged-eager"
        texts = []
        for fixed_k in (4, None):
            settings = EdgeSettings(cloud_url=cloud.http_url, draft=str(draft), temperature=0.0, top_p=1.0,
                                    repetition_penalty=1.0, fixed_k=fixed_k, max_new_tokens=NEW_TOKENS,
                                    stop_at_eos=False, timeout_fallback=False, stream_switch=False)
            client = EdgeClient(settings)
            try:
                texts.append(client.generate(PROMPT))
            finally:
                client.close()
    expected = greedy_reference(target, texts[0].prompt_ids, NEW_TOKENS)
    assert [t.token_ids for t in texts] == [expected, expected]
    assert any(r.accepted_len > 0 for r in texts[0].rounds)
    assert texts[1].metrics.tree_rounds > 0  # the edge's defaults sent trees
