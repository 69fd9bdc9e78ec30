"""`specsplit-edge serve` as a real process in front of the real cloud, driven by the official `openai` package.

Two edge servers share one cloud (the bundled demo target): one drafts with the demo draft model
and has a small chat template file (the demo tokenizer has none), one drafts with the n-gram
drafter and has no chat template. Greedy answers are compared with the cloud's own target-only
greedy decoding (POST /v1/generate) of the same prompt ids; for chat, of the templated prompt.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.cloud_proc import free_port
from tests.server import REPO, CloudProcess

MODEL = "demo-target"
N_NEW = 20
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPTS = ["def fib(n):\n", "The lighthouse keeper had not spoken to another person in eleven days.",
           "import os\nimport sys\n\n\ndef main():\n", "Dear Margaret, I hope this letter finds you well."]


class EdgeServeProcess:
    """`specsplit-edge serve ARGS` on a free loopback port: `spawn()`, `wait_ready()` (GET /healthz), `stop()`."""

    def __init__(self, args: list[str], startup_timeout_s: float = 90.0) -> None:
        self.port = free_port()
        script = Path(sys.executable).parent / "specsplit-edge"
        self.command = [str(script), "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.startup_timeout_s = startup_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="specsplit-edge-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-30:])

    def spawn(self) -> EdgeServeProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        return self

    def wait_ready(self) -> EdgeServeProcess:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specsplit-edge serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"specsplit-edge serve not ready:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


# exact verification: no lossy timeout fallback, whatever the shared machine's load
EXACT = ["--timeout-ms", "30000", "--no-timeout-fallback", "--threads", "1"]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def stack(demo_target_dir: Path, demo_draft_dir: Path, template_file: Path,
          ) -> Iterator[tuple[CloudProcess, EdgeServeProcess, EdgeServeProcess]]:
    """The cloud and two edge servers, started side by side (an edge server asks the cloud for
    nothing until its first request): (cloud, model-draft server with a template, n-gram server)."""
    cloud = CloudProcess(demo_target_dir)
    model = EdgeServeProcess(["--cloud", cloud.http_url, "--draft", str(demo_draft_dir),
                              "--chat-template", str(template_file), *EXACT])
    ngram = EdgeServeProcess(["--cloud", cloud.http_url, "--draft", "ngram", "--tokenizer", str(demo_target_dir),
                              "--served-model-name", "local-model", *EXACT])
    try:
        model.spawn()
        ngram.spawn()
        with cloud:
            model.wait_ready()
            ngram.wait_ready()
            yield cloud, model, ngram
    finally:
        model.stop()
        ngram.stop()


@pytest.fixture(scope="module")
def cloud_server(stack: tuple[CloudProcess, EdgeServeProcess, EdgeServeProcess]) -> CloudProcess:
    return stack[0]


@pytest.fixture(scope="module")
def model_server(stack: tuple[CloudProcess, EdgeServeProcess, EdgeServeProcess]) -> EdgeServeProcess:
    return stack[1]


@pytest.fixture(scope="module")
def ngram_server(stack: tuple[CloudProcess, EdgeServeProcess, EdgeServeProcess]) -> EdgeServeProcess:
    return stack[2]


@pytest.fixture(scope="module")
def api(model_server: EdgeServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(demo_target_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_target_dir)


def target_greedy(cloud: CloudProcess, tok: Any, prompt_ids: list[int], n: int = N_NEW) -> tuple[str, int]:
    """(text, tokens) of the cloud's target-only greedy decoding, stopping at end of text."""
    r = httpx.post(cloud.http_url + "/v1/generate", timeout=120, json={
        "prompt_ids": prompt_ids, "sampling_cfg": {"temperature": 0}, "max_new_tokens": n})
    r.raise_for_status()
    ids = r.json()["token_ids"]
    return str(tok.decode(ids, skip_special_tokens=True)), len(ids)


def chat_prompt_ids(tok: Any, user: str) -> list[int]:
    return list(tok.encode(f"<|user|>\n{user}\n<|assistant|>\n", add_special_tokens=False))


def metric(url: str, name: str) -> float:
    """Sum of the samples of `name` (all label sets) on a Prometheus page."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_models_lists_the_cloud_model_or_the_served_name(api: openai.OpenAI, ngram_server: EdgeServeProcess) -> None:
    assert [m.id for m in api.models.list()] == [MODEL]
    other = openai.OpenAI(base_url=ngram_server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in other.models.list()] == ["local-model"]
    assert httpx.get(ngram_server.url + "/healthz").json() == {"status": "ok"}


def test_greedy_completion_equals_target_greedy_with_usage_and_specsplit(
        api: openai.OpenAI, model_server: EdgeServeProcess, cloud_server: CloudProcess, tok: Any) -> None:
    ids = list(tok.encode(PROMPTS[0]))
    want, n_tokens = target_greedy(cloud_server, tok, ids)
    tokens_before = metric(model_server.url, "specsplit_edge_tokens_total")
    r = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_NEW, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == ("length" if n_tokens == N_NEW else "stop")
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids), n_tokens, len(ids) + n_tokens)
    ext = r.model_extra["specsplit"] if r.model_extra else {}
    assert ext["rounds"] >= 1 and sum(ext["tokens_by_origin"].values()) == n_tokens
    assert ext["local_commits"] == 0 and 0 <= ext["acceptance_rate"] <= 1
    assert metric(model_server.url, "specsplit_edge_tokens_total") - tokens_before == n_tokens


def test_streamed_completion_equals_the_unstreamed_one_and_reports_usage(api: openai.OpenAI) -> None:
    """Sampled (temperature 0.9, seed 7): the seed fixes the text, streamed or not."""
    kw: dict[str, Any] = {"model": MODEL, "prompt": [PROMPTS[1]], "max_tokens": N_NEW, "temperature": 0.9,
                          "seed": 7}
    whole = api.completions.create(**kw)
    chunks = list(api.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_greedy_chat_equals_target_greedy_of_the_templated_prompt_streamed_or_not(
        api: openai.OpenAI, cloud_server: CloudProcess, tok: Any) -> None:
    user = "Write a function that adds two numbers."
    ids = chat_prompt_ids(tok, user)
    want, n_tokens = target_greedy(cloud_server, tok, ids)
    msgs: Any = [{"role": "user", "content": user}]
    r = api.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=N_NEW, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n_tokens)
    chunks = list(api.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N_NEW, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_sequence_cuts_the_text_before_it_and_finishes_with_stop(
        api: openai.OpenAI, cloud_server: CloudProcess, tok: Any) -> None:
    ids = list(tok.encode(PROMPTS[2]))
    full, _ = target_greedy(cloud_server, tok, ids, 24)
    stop = full.strip()[3:6]  # a piece from the middle of the greedy text
    assert stop and stop in full
    want = full[:full.index(stop)]
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0,
                          "stop": [stop, "\x00never"]}
    r = api.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(api.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_four_concurrent_requests_each_get_their_own_target_text(
        api: openai.OpenAI, cloud_server: CloudProcess, tok: Any) -> None:
    wants = [target_greedy(cloud_server, tok, list(tok.encode(p)))[0] for p in PROMPTS]
    start = threading.Barrier(len(PROMPTS))

    def ask(prompt: str) -> str:
        start.wait()
        return api.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW,
                                      temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, PROMPTS))
    assert got == wants


@pytest.mark.parametrize("extra", [
    {"n": 2}, {"logprobs": 2}, {"echo": True}, {"best_of": 3}, {"presence_penalty": 0.5},
    {"temperature": 3.0}, {"stop": ""}, {"prompt": ["one", "two"]}, {"extra_body": {"mirostat": 1}},
])
def test_invalid_or_unsupported_input_is_a_bad_request_naming_the_field(
        api: openai.OpenAI, cloud_server: CloudProcess, extra: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(**kw)
    body: Any = err.value.body
    named = next(iter(extra["extra_body"])) if "extra_body" in extra else next(iter(extra))
    assert body["param"] == named and named in body["message"]
    assert body["type"] == "invalid_request_error"
    assert metric(cloud_server.http_url, "specsplit_cloud_open_sessions") == 0


def test_chat_without_a_template_says_how_to_pass_one_and_unknown_models_are_not_found(
        ngram_server: EdgeServeProcess) -> None:
    other = openai.OpenAI(base_url=ngram_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        other.chat.completions.create(model="local-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        other.chat.completions.create(model="local-model", messages=[{"role": "user", "content": "hi"}],
                                      logprobs=True)


def test_ngram_server_greedy_equals_target_greedy(ngram_server: EdgeServeProcess, cloud_server: CloudProcess,
                                                   tok: Any) -> None:
    other = openai.OpenAI(base_url=ngram_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "a b c a b c a b c a b c"
    want, _ = target_greedy(cloud_server, tok, list(tok.encode(prompt)))
    r = other.completions.create(model="local-model", prompt=prompt, max_tokens=N_NEW, temperature=0)
    assert r.choices[0].text == want


def test_a_client_that_disconnects_mid_stream_cancels_and_closes_its_cloud_session(
        api: openai.OpenAI, model_server: EdgeServeProcess, cloud_server: CloudProcess) -> None:
    cancelled = 'specsplit_edge_generations_total{endpoint="completions",finish="cancelled"}'
    before = metric(model_server.url, cancelled)
    stream = api.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=480, temperature=1.0, seed=3,
                                    stream=True)
    next(iter(stream))
    assert metric(cloud_server.http_url, "specsplit_cloud_open_sessions") == 1  # generating now
    stream.close()
    deadline = time.monotonic() + 20
    while metric(cloud_server.http_url, "specsplit_cloud_open_sessions") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(cloud_server.http_url, "specsplit_cloud_open_sessions") == 0
    while metric(model_server.url, cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(model_server.url, cancelled) == before + 1  # it ended by cancellation, not by finishing


def test_a_client_that_gives_up_on_a_whole_answer_cancels_it_too(
        model_server: EdgeServeProcess, cloud_server: CloudProcess) -> None:
    cancelled = 'specsplit_edge_generations_total{endpoint="chat",finish="cancelled"}'
    before = metric(model_server.url, cancelled)
    impatient = openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused", max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tell me a story"}],
                                          max_tokens=480, temperature=1.0, seed=5)
    deadline = time.monotonic() + 20
    while metric(model_server.url, cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(model_server.url, cancelled) == before + 1
    assert metric(cloud_server.http_url, "specsplit_cloud_open_sessions") == 0
