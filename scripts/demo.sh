#!/usr/bin/env bash
# The README's demo command: install (setup converts the standard target once), start the cloud
# verifier on loopback with SmolLM2-135M-Instruct (models/smollm2-135m-instruct), run the edge
# client against it with the attention head (models/smollm2-135m-attention-head, fed the target's
# states by the cloud; the draft cut from the target, models/smollm2-135m-draft-from-target, as its fallback), the prompt sent as a
# user message through the tokenizer's chat template, greedy (the target's own greedy answer;
# pass --temperature 0.7 for a sampled one), text streaming as it is committed, then stop the cloud.
# Usage: bash scripts/demo.sh ["PROMPT"] [extra specsplit-edge flags]
# SPECSPLIT_DEMO_PAIR=tiny runs the old bundled toy pair (models/demo-target, models/demo-draft) instead.
# One torch thread per process: cloud and edge share this machine's cores, and two
# multi-threaded torch processes on two cores slow each other down many times over.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,bench >/dev/null
prompt=${1:-"Write a Python function that returns the n-th Fibonacci number."}
shift || true
http_port=${SPECSPLIT_DEMO_HTTP_PORT:-8000}
grpc_port=${SPECSPLIT_DEMO_GRPC_PORT:-50051}
log=$(mktemp -t specsplit-cloud.XXXXXX.log)
draft_note=""
if [ "${SPECSPLIT_DEMO_PAIR:-real}" = tiny ]; then
  target=models/demo-target; draft=models/demo-draft; edge_flags=()
else
  target=models/smollm2-135m-instruct; draft=models/smollm2-135m-draft-from-target; edge_flags=(--chat --temperature 0)
  draft_note="the attention head models/smollm2-135m-attention-head, falling back to "
fi
echo "demo pair: target $target, draft ${draft_note:-}$draft${edge_flags:+ (prompt sent as a chat user message, greedy)}"
port_free() {
  .venv/bin/python -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2>/dev/null
}
port_free "$http_port" || { echo "demo: port $http_port on 127.0.0.1 is in use (another specsplit-cloud?): stop that process or set SPECSPLIT_DEMO_HTTP_PORT=PORT" >&2; exit 1; }
port_free "$grpc_port" || { echo "demo: port $grpc_port on 127.0.0.1 is in use (another specsplit-cloud?): stop that process or set SPECSPLIT_DEMO_GRPC_PORT=PORT" >&2; exit 1; }

.venv/bin/specsplit-cloud --model "$target" --host 127.0.0.1 \
  --http-port "$http_port" --grpc-port "$grpc_port" --torch-threads 1 >"$log" 2>&1 &
cloud=$!
trap 'kill $cloud 2>/dev/null; wait $cloud 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  if .venv/bin/python -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$http_port/readyz').status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 $cloud 2>/dev/null || { echo "cloud failed to start: $(grep -v '^{' "$log" | tail -n 1) (log: $log)" >&2; exit 1; }
  sleep 0.5
done
echo "cloud verifier ready on http://127.0.0.1:$http_port (gRPC :$grpc_port); log: $log"
.venv/bin/specsplit-edge generate "$prompt" --cloud "http://127.0.0.1:$http_port" \
  --draft "$draft" --mode speculative --max-new-tokens 160 --threads 1 "${edge_flags[@]}" "$@"
