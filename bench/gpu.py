"""`specsplit-bench --only gpu`: the cloud on one CUDA host, in one command (about 5 minutes).

    specsplit-bench --only gpu [--gpu-shapes coder-1.5b,qwen2.5-7b] [--out BENCHMARKS.md]
    SPECSPLIT_GPU_OUT=DIR ...   # also writes DIR/gpu.jsonl (every record) and DIR/gpu.md (the tables)

Real weights rarely reach a GPU host, and a forward's time does not depend on the weights' values, so each shape
(`SHAPES`: Qwen2.5-Coder-1.5B-Instruct's and Qwen2.5-7B-Instruct's configs) is built with random weights in
bfloat16 on the device; the tokenizer is the first of TOKENIZERS found under models/. In order:

1. **The forward by shape** (`TargetModel.forward`, context 512, median of REPEATS after WARMUP): new tokens of one
   session 1..64, a token tree of 16 nodes, 8 and 32 sessions' decode steps, 32 sessions' chains of 8; for the
   transformers path (the PyTorch runner before graphs), the graph executor plain and batch-invariant (with its
   start-up invariance probe's answer); against transformers' own eager forward (DynamicCache) and its StaticCache
   step captured in a CUDA graph; the GPU's kernel time of a one-token forward (torch profiler).
2. **The server** (coder shape, saved with its output layer scaled so greedy choices are not near-ties): the cloud at
   its default flags on CUDA; /v1/model's forward path, batch invariance and fitted cost; cloud_only through
   /v1/generate (one stream, 256 tokens); edges at their defaults with a tiny random draft and with the target's own
   weights as the draft (on this host's CPU), every text compared with the cloud's own (`--against-cloud-only`);
   the cost fit after that load against the marginal row cost measured in part 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench.cloud_proc import REPO, CloudServer

COMMON: dict[str, Any] = dict(model_type="qwen2", hidden_act="silu", max_position_embeddings=32768,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False,
                              tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
SHAPES: dict[str, dict[str, Any]] = {
    "coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
    # a dry run on a CPU (`--gpu-shapes tiny`)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152),
}
DRAFT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TOKENIZERS = ("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct", "smollm2-135m-draft")
TOKEN_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CONTEXT, WARMUP, REPEATS = 512, 3, 15
# (executor, batch-invariant, kernels: --attention, "+fused" for --fused-kernels), named by `path_name`
PATHS = (("transformers", False, "sdpa"), ("graphs", False, "sdpa"), ("graphs", True, "sdpa"),
         ("graphs", True, "triton"), ("graphs", True, "sdpa+fused"))


def path_name(p: tuple[str, bool, str]) -> str:
    """transformers, graphs, graphs-invariant, graphs-triton-invariant, graphs-fused-invariant, ..."""
    return (p[0] + ("-triton" if p[2].startswith("triton") else "") + ("-fused" if p[2].endswith("+fused") else "")
            + ("-invariant" if p[1] else ""))
START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"


def _emit(records: list[dict[str, Any]], rec: dict[str, Any]) -> None:
    records.append(rec)
    print(json.dumps(rec), flush=True)
    out = os.environ.get("SPECSPLIT_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "gpu.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def model_dir(shape: str, dst: Path) -> Path:
    """A directory with `shape`'s config and a tokenizer from models/ (no weights)."""
    from transformers import Qwen2Config

    dst.mkdir(parents=True, exist_ok=True)
    Qwen2Config(**{**COMMON, **SHAPES[shape]}).save_pretrained(dst)
    src = next((REPO / "models" / t for t in TOKENIZERS if (REPO / "models" / t / "tokenizer.json").exists()), None)
    if src is None:
        raise SystemExit(f"no tokenizer under models/ ({', '.join(TOKENIZERS)}): run bash scripts/setup.sh")
    for f in TOKEN_FILES:
        if (src / f).exists():
            (dst / f).write_bytes((src / f).read_bytes())
    return dst


def random_lm(d: Path, device: str, dtype: torch.dtype, head_scale: float = 1.0) -> Any:
    """The causal LM of d's config with random weights, made on the device (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=dtype, attn_implementation="sdpa")
    if head_scale != 1.0:
        with torch.no_grad():
            m.get_output_embeddings().weight.mul_(head_scale)
    return m.eval()


@contextlib.contextmanager
def random_weights(model: Any) -> Iterator[None]:
    """TargetModel loads `model` (random weights already on the device) instead of reading a checkpoint."""
    import cloud.runners.torch_runner as tr

    real = tr.load_causal_lm
    tr.load_causal_lm = lambda *a, **k: model  # type: ignore[assignment]
    try:
        yield
    finally:
        tr.load_causal_lm = real


# --- 1. the forward by shape ---------------------------------------------------------------------------------
def forward_table(target: Any, dev: str, ids: Callable[[int], list[int]]) -> dict[str, float]:
    """Median wall ms of `target.forward` by shape, every session at CONTEXT cached positions."""
    from shared.rows import Row

    slots = []
    for _ in range(32):
        s = target.pool.allocate()
        for c in range(0, CONTEXT, 128):
            target.forward([Row(s, c, ids(128), 0)])
        target.pool.set_length(s, CONTEXT)
        slots.append(s)

    def timed(rows_of: Callable[[], list[Any]]) -> float:
        ts = []
        for i in range(WARMUP + REPEATS):
            rows = rows_of()
            _sync(dev)
            t = time.perf_counter()
            target.forward(rows)
            _sync(dev)
            if i >= WARMUP:
                ts.append((time.perf_counter() - t) * 1000)
            for r in rows:
                target.pool.crop(r.seq_id, r.num_cached_tokens)
        return round(statistics.median(ts), 3)

    res: dict[str, float] = {}
    for n in (1, 2, 4, 8, 16, 32, 64):
        res[f"new{n}"] = timed(lambda n=n: [Row(slots[0], CONTEXT, ids(n), n)])  # type: ignore[misc]
    parents = tuple([-1] + list(range(7)) + [-1] + list(range(8, 15)))  # two branches of depth 8
    res["tree16"] = timed(lambda: [Row(slots[0], CONTEXT, ids(16), 16, tree=parents, tree_base=CONTEXT)])
    for s in (8, 32):
        res[f"decode{s}"] = timed(lambda s=s: [Row(x, CONTEXT, ids(1), 1) for x in slots[:s]])  # type: ignore[misc]
    res["chain32x8"] = timed(lambda: [Row(x, CONTEXT, ids(8), 8) for x in slots[:32]])
    if dev.startswith("cuda"):
        res["gpu_busy_new1"] = gpu_busy_ms(lambda: target.forward([Row(slots[0], CONTEXT, ids(1), 1)]),
                                           lambda: target.pool.crop(slots[0], CONTEXT))
    for s in slots:
        target.pool.release(s)
    return res


def gpu_busy_ms(fn: Callable[[], Any], after: Callable[[], None]) -> float:
    """The GPU kernels' own time in one call of fn (the floor graphs approach)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    after()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    after()
    return round(sum(e.self_device_time_total for e in prof.key_averages()) / 1000, 3)


def hf_baselines(hf: Any, dev: str, ids: Callable[[int], list[int]]) -> dict[str, Any]:
    """transformers' own eager forward (DynamicCache) and its StaticCache step in a CUDA graph, at CONTEXT."""
    from transformers import DynamicCache

    out: dict[str, Any] = {}
    x = torch.tensor([ids(CONTEXT)], device=dev)
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(input_ids=x, past_key_values=cache, use_cache=True)
        for n in (1, 8):
            ts = []
            for i in range(WARMUP + REPEATS):
                y = torch.tensor([ids(n)], device=dev)
                _sync(dev)
                t = time.perf_counter()
                hf(input_ids=y, past_key_values=cache, use_cache=True)
                _sync(dev)
                if i >= WARMUP:
                    ts.append((time.perf_counter() - t) * 1000)
                cache.crop(-n)
            out[f"eager_new{n}"] = round(statistics.median(ts), 3)
        if dev.startswith("cuda"):
            try:
                out["graph_new1"] = _static_graph_step(hf, x, dev)
            except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                out["graph_new1"] = repr(e)[:200]
    return out


def _static_graph_step(hf: Any, x: torch.Tensor, dev: str) -> float:
    from transformers import StaticCache

    cache = StaticCache(config=hf.config, max_cache_len=CONTEXT + 64)
    hf(input_ids=x, past_key_values=cache, cache_position=torch.arange(CONTEXT, device=dev), use_cache=True)
    inp = torch.zeros(1, 1, dtype=torch.long, device=dev)
    cpos = torch.arange(CONTEXT, CONTEXT + 1, device=dev)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            hf(input_ids=inp, past_key_values=cache, cache_position=cpos, use_cache=True)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hf(input_ids=inp, past_key_values=cache, cache_position=cpos, use_cache=True)
    ts = []
    for i in range(WARMUP + REPEATS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        if i >= WARMUP:
            ts.append((time.perf_counter() - t) * 1000)
    del g
    return round(statistics.median(ts), 3)


def micro(shape: str, dev: str, records: list[dict[str, Any]], work: Path,
          paths: tuple[tuple[str, bool, str], ...] = PATHS) -> None:
    from cloud.runners.torch_runner import TargetModel

    d = model_dir(shape, work / shape)
    hf = random_lm(d, dev, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    vocab = 49152  # inside every tokenizer of TOKENIZERS

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    baselines = any(p[0] == "transformers" for p in paths)
    for executor, invariant, attention in paths:
        if invariant and baselines:  # transformers' own forwards before an invariant path tiles the linear layers
            _emit(records, {"part": "hf", "shape": shape, **hf_baselines(hf, dev, ids)})
            baselines = False
        t0 = time.perf_counter()
        target = None
        try:  # a path the device refuses is recorded, and the next path still runs
            with random_weights(hf):
                target = TargetModel(d, dev, "bfloat16", invariant=invariant, executor=executor,
                                     attention=attention.split("+")[0], fused_kernels=attention.endswith("+fused"))
            ms = forward_table(target, dev, ids)
            p = target.paged
            if p is not None and not invariant:  # measured all the same: is the plain executor invariant here?
                from cloud.runners.invariance import paged_invariance

                target.invariance_failure = paged_invariance(target, 1024)[0] or "none found (probe passed)"
            _emit(records, {"part": "forward", "shape": shape, "path": target.info.forward_path +
                            ("+triton" if attention.startswith("triton") else "") +
                            ("+fused" if attention.endswith("+fused") else ""),
                            "invariant_asked": invariant, "batch_invariant": target.info.batch_invariant,
                            "invariance": getattr(target, "invariance_failure", ""), "setup_s":
                            round(time.perf_counter() - t0, 1), "ms": ms, **({"graphs": p.facts()} if p else {})})
        except Exception as e:  # noqa: BLE001 - the next path still runs
            _emit(records, {"part": "forward", "shape": shape, "path": path_name((executor, invariant, attention)),
                            "invariant_asked": invariant,
                            "error": repr(e)[:400]})
        del target
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    del hf
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()


# --- 2. the server -------------------------------------------------------------------------------------------
def save_models(work: Path, dev: str, shape: str) -> tuple[Path, Path]:
    """The target (`shape`, random, output layer scaled by 8) and a tiny random draft, saved with the tokenizer."""
    target = model_dir(shape, work / "served-target")
    m = random_lm(target, dev, torch.bfloat16, head_scale=8.0)
    m.save_pretrained(target)
    del m
    draft = work / "served-draft"
    from transformers import Qwen2Config

    model_dir(shape, draft)
    Qwen2Config(**{**COMMON, **SHAPES[shape], **DRAFT}).save_pretrained(draft)
    random_lm(draft, "cpu", torch.float32).save_pretrained(draft)
    return target, draft


def generate_rate(url: str, ids: list[int], n: int, temperature: float = 0.0) -> dict[str, Any]:
    """One /v1/generate stream of n tokens: tokens per second over the whole call (prefill included) and between
    the first and the last token (the steady decode a user sees), by the client's clock."""
    import httpx

    body = {"prompt_ids": ids, "max_new_tokens": n, "stop_at_eos": False, "stream": True,
            "sampling_cfg": {"temperature": temperature}}
    t = time.perf_counter()
    stamps = []
    with httpx.stream("POST", url + "/v1/generate", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:]).get("token_id") is not None:
                stamps.append(time.perf_counter())
    wall = time.perf_counter() - t
    toks = len(stamps)
    steady = (toks - 1) / (stamps[-1] - stamps[0]) if toks > 1 and stamps[-1] > stamps[0] else None
    return {"tokens": toks, "temperature": temperature, "wall_s": round(wall, 3),
            "tokens_per_s_wall": round(toks / wall, 1), "first_token_ms": round((stamps[0] - t) * 1000, 1) if stamps
            else None, "decode_tokens_per_s_wall": round(steady, 1) if steady else None}


def edge(url: str, prompt: str, draft: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "edge.cli", "generate", prompt, "--cloud", url, "--draft", str(draft),
           "--temperature", "0", "--max-new-tokens", "64", "--against-cloud-only", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"prompt": prompt, "extra": extra, "error": f"timed out after {timeout} s"}
    line = next((ln for ln in p.stderr.splitlines() if ln.startswith("decode:")), "")
    return {"prompt": prompt, "extra": extra, "rc": p.returncode, "against_cloud_only": line,
            "same_text": "the same text" in line, "summary": p.stderr[-2500:]}


def server(dev: str, records: list[dict[str, Any]], work: Path, shape: str) -> None:
    import httpx

    t0 = time.perf_counter()
    target, draft = save_models(work, dev, shape)
    _emit(records, {"part": "saved", "seconds": round(time.perf_counter() - t0, 1)})
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 49152, (64,), generator=g).tolist()
    try:
        cloud = CloudServer(target, device=dev, torch_threads=0, startup_timeout_s=300).start()
    except RuntimeError as e:  # the default flags failed: say how, and measure the rest without invariance
        _emit(records, {"part": "server", "flags": "defaults", "error": str(e)[-1500:]})
        cloud = CloudServer(target, device=dev, torch_threads=0, startup_timeout_s=300,
                            extra_args=["--batch-invariant", "false"]).start()
    try:
        info = httpx.get(cloud.url + "/v1/model", timeout=30).json()
        _emit(records, {"part": "model", **{k: info.get(k) for k in ("forward_path", "batch_invariant", "numerics",
                                                                     "dtype", "device", "forward_cost")}})
        rates = [generate_rate(cloud.url, prompt, 256, t) for t in (0.0, 0.0, 0.0, 1.0)]
        _emit(records, {"part": "cloud_only", "runs": rates})
        from concurrent.futures import ThreadPoolExecutor

        t = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(lambda i: generate_rate(cloud.url, [i + 1, *prompt], 256), range(8)))
        wall = time.perf_counter() - t
        _emit(records, {"part": "cloud_only x8", "tokens_per_s_total": round(sum(r["tokens"] for r in runs) / wall, 1),
                        "per_stream": [r["tokens_per_s_wall"] for r in runs]})
        for p in ("def quicksort(xs):", "import os"):
            _emit(records, {"part": "edge", "draft": "tiny", **edge(cloud.url, p, draft, [], 120)})
        _emit(records, {"part": "edge", "draft": "target's weights (host CPU)",
                        **edge(cloud.url, "class Node:", target, ["--k", "8", "--no-stream-switch"], 150)})
        info = httpx.get(cloud.url + "/v1/model", timeout=30).json()
        _emit(records, {"part": "fit", "forward_cost": info.get("forward_cost")})
    finally:
        cloud.stop()


# --- the report ----------------------------------------------------------------------------------------------
def report(records: list[dict[str, Any]], command: str, machine: str) -> str:
    cols = ["new1", "new8", "new16", "new64", "tree16", "decode8", "decode32", "chain32x8"]
    lines = [f"Command: `{command}`. {machine}. Context {CONTEXT}, bfloat16, random weights of each shape; wall "
             f"ms, median of {REPEATS} after {WARMUP} warm-ups (part 1: {', '.join(cols)}).", "",
             "| shape | path | invariant (measured) | " + " | ".join(cols) + " | verify 8 / 1 | 32x8 / 1 | GPU busy new1 |",
             "|" + "---|" * (len(cols) + 6)]
    for r in records:
        if r.get("part") == "forward" and "ms" in r:
            ms = r["ms"]
            inv = f"{'yes' if r['batch_invariant'] else 'no'}" if r["invariant_asked"] else "off"
            lines.append(f"| {r['shape']} | {r['path']} | {inv} | " + " | ".join(f"{ms[c]:.2f}" for c in cols) +
                         f" | {ms['new8'] / ms['new1']:.2f}x | {ms['chain32x8'] / ms['new1']:.2f}x | "
                         f"{ms.get('gpu_busy_new1', '')} |")
        elif r.get("part") == "forward":
            lines.append(f"| {r['shape']} | {r['path']} | error | {r['error']} |")
    for r in records:
        if r.get("part") == "hf":
            lines.append(f"\ntransformers' own, {r['shape']}: eager 1 token {r.get('eager_new1')} ms, 8 tokens "
                         f"{r.get('eager_new8')} ms; StaticCache step in a CUDA graph {r.get('graph_new1')} ms.")
        if r.get("part") == "forward" and r.get("invariance"):
            lines.append(f"\nInvariance probe, {r['shape']} {r['path']}: {r['invariance']}")
    for r in records:
        if r.get("part") == "forward" and "ms" in r:
            ms = r["ms"]
            lines.append(f"\nMarginal row cost measured, {r['shape']} {r['path']} (invariant {r['invariant_asked']}): "
                         f"{(ms['new16'] - ms['new8']) / 8:.4f} ms from 8 to 16 rows, "
                         f"{(ms['chain32x8'] - ms['decode32']) / 224:.4f} ms from 32 to 256 rows.")
    for r in records:
        if r.get("part") in ("model", "cloud_only", "cloud_only x8", "edge", "fit", "server"):
            lines.append(f"\n- {r['part']}: `{json.dumps({k: v for k, v in r.items() if k != 'part'})}`")
    return "\n".join(lines) + "\n"


def run(out: Path, command: str, shapes: tuple[str, ...], server_shape: str | None = "coder-1.5b",
        paths: tuple[str, ...] = ("transformers", "graphs", "graphs-invariant", "graphs-triton-invariant",
                                  "graphs-fused-invariant")) -> int:
    chosen = tuple(p for p in PATHS if path_name(p) in paths)
    import tempfile

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    machine = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
               if dev == "cuda" else "CPU (no CUDA device: a dry run)")
    records: list[dict[str, Any]] = []
    _emit(records, {"part": "env", "machine": machine, "date": time.strftime("%Y-%m-%d")})
    with tempfile.TemporaryDirectory(prefix="specsplit-gpu-") as tmp:
        work = Path(tmp)
        for i, shape in enumerate(shapes):
            try:
                micro(shape, dev, records, work, chosen)
            except Exception as e:  # noqa: BLE001 - the other parts still run
                _emit(records, {"part": "forward", "shape": shape, "path": "all", "invariant_asked": False,
                                "error": repr(e)[:600]})
            if server_shape and i == 0:  # the server right after the first shape's table
                try:
                    server(dev, records, work, server_shape)
                except Exception as e:  # noqa: BLE001 - part 1's tables are still written
                    _emit(records, {"part": "server", "error": repr(e)[:1500]})
    text = report(records, command, machine)
    print(text)
    side = os.environ.get("SPECSPLIT_GPU_OUT")
    if side:
        (Path(side) / "gpu.md").write_text(text)
    if out.exists() and START in out.read_text():
        doc = out.read_text()
        out.write_text(doc[: doc.index(START) + len(START)] + "\n" + text + doc[doc.index(END):])
    return 0
