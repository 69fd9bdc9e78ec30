#!/usr/bin/env bash
# The README's test command: install what is needed, then run the whole test suite, then the exactness
# suite again against a bfloat16 cloud with bfloat16 drafts (one seed one text, greedy equality, trees, streams:
# the suite pins cloud and draft to float32 unless SPECSPLIT_TEST_DTYPE names another dtype).
# SPECSPLIT_TEST_RUNNER=llamacpp runs a selection against the llama.cpp runner instead (each tiny target served
# from a GGUF of its weights; tests/server.py); its forwards are not batch-invariant, so the tests that compare
# texts across batch shapes do not apply to it.
# Extra arguments go to pytest and run that selection alone (e.g. bash scripts/test.sh tests/shared -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,bench
bash scripts/install_nginx.sh   # the replica tests run a real nginx
bash scripts/install_prometheus.sh   # the ops tests run promtool and a real Prometheus
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
.venv/bin/python -m pytest -q --durations=25
echo "== the exactness suite against a bfloat16 cloud, with bfloat16 drafts"
SPECSPLIT_TEST_DTYPE=bfloat16 .venv/bin/python -m pytest -q tests/e2e/test_seeded_text.py \
  tests/e2e/test_session_stream.py tests/e2e/test_edge_greedy.py tests/e2e/test_tree_rounds.py
