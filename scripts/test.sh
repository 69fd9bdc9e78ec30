#!/usr/bin/env bash
# The README's test command: install what is needed, then run the whole test suite, then the exactness
# suite again against a bfloat16 cloud with bfloat16 drafts (one seed one text, greedy equality, trees, streams:
# the suite pins cloud and draft to float32 unless SPECSPLIT_TEST_DTYPE names another dtype).
# SPECSPLIT_TEST_RUNNER=llamacpp runs a selection against the llama.cpp runner instead (each tiny target served
# from a GGUF of its weights; tests/server.py); its forwards are not batch-invariant, so the tests that compare
# texts across batch shapes do not apply to it.
# Extra arguments go to pytest and run that selection alone (e.g. bash scripts/test.sh tests/shared -x).
# nginx and prometheus come from Debian's packages (apt-get) when missing, and only when the tests run need them:
# the whole suite always; a selection when one of its files (or the files under its folders) runs nginx or
# promtool / Prometheus (SERVES_NGINX, SERVES_PROMETHEUS below). A selection naming no path under tests/ (only -k,
# -m, ...) runs the whole suite's files, so it needs both.
set -euo pipefail
cd "$(dirname "$0")/.."
# what a test file that runs nginx or Prometheus holds: an import of the local cluster (bench/cluster.py), of the
# nginx binary's finder (bench/nginx_conf.py) or of the replica tests' helpers; a call of tests/ops/tools.py's
# promtool(...) or binary("prometheus")
SERVES_NGINX='bench\.cluster|bench\.nginx_conf|tests\.e2e\.replicas|nginx_binary'
SERVES_PROMETHEUS='promtool\(|binary\("prometheus"\)'

needs() {  # needs PATTERN [ARG...]: whether the selection ARGS (no test path: the whole suite) has a file matching PATTERN
  local pattern=$1 arg path paths=0
  shift
  for arg in "$@"; do
    path=${arg%%::*}   # tests/x.py::test_y -> tests/x.py
    case $path in tests | tests/* | ./tests | ./tests/*) ;; *) continue ;; esac
    [ -e "$path" ] || continue
    paths=$((paths + 1))
    grep -rqE --include='*.py' "$pattern" "$path" && return 0
  done
  [ "$paths" -eq 0 ]
}

bash scripts/setup.sh dev,bench
if needs "$SERVES_NGINX" "$@"; then
  bash scripts/install_nginx.sh   # the replica tests run a real nginx, the TLS recipe's test nginx -t
fi
if needs "$SERVES_PROMETHEUS" "$@"; then
  bash scripts/install_prometheus.sh   # the ops tests run promtool and a real Prometheus
fi
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
# The whole suite runs as two pytest processes at once, which a 2-core machine runs side by side: the
# compute-bound pass (tests/shared: batch invariance bit for bit, the toy exactness chi-squares; then the bfloat16
# exactness pass) and everything else. Each pass keeps about one core busy (models at one torch thread, each cloud
# process at one), so together they take about the longer one's time instead of the sum. They share no port
# (every cloud, proxy and server asks the OS for free ones), no temporary folder (a --basetemp each) and no
# pytest cache (the background pass runs without one). The background pass's output follows the main pass's.
# The background pass also takes the slowest end-to-end files (multi-rank groups, many architectures, the real
# pair, the sampling chi-squares), which balances the two: 1,178 s against 441 s before, on a 2-core Xeon.
heavy=(tests/e2e/test_tensor_parallel.py tests/e2e/test_tensor_parallel_invariant.py tests/e2e/test_architectures.py
       tests/e2e/test_real_pair.py tests/e2e/test_edge_sampling.py tests/research/e2e/test_head_sampling.py
       tests/research/e2e/test_real_pair_heads.py)
work=$(mktemp -d)
(
  rc=0
  .venv/bin/python -m pytest -q --durations=60 -p no:cacheprovider --basetemp="$work/shared" tests/shared \
    "${heavy[@]}" || rc=$?
  echo "== the exactness suite against a bfloat16 cloud, with bfloat16 drafts"
  # (the bfloat16-draft test of test_seeded_text.py runs in the main pass already: its draft is bfloat16 there too)
  SPECSPLIT_TEST_DTYPE=bfloat16 .venv/bin/python -m pytest -q --durations=10 -p no:cacheprovider \
    --basetemp="$work/bf16" tests/e2e/test_seeded_text.py tests/e2e/test_session_stream.py \
    tests/e2e/test_edge_greedy.py tests/e2e/test_tree_rounds.py \
    -k "not test_a_bfloat16_draft_gives_one_text_under_any_round_structure" || rc=$?
  exit $rc
) > "$work/background.log" 2>&1 &
background=$!
trap 'kill "$background" 2>/dev/null; rm -rf "$work"' EXIT
rc=0
.venv/bin/python -m pytest -q --durations=60 --basetemp="$work/main" --ignore=tests/shared \
  "${heavy[@]/#/--ignore=}" || rc=$?
bg=0
wait "$background" || bg=$?
trap 'rm -rf "$work"' EXIT
echo "== tests/shared and the slowest end-to-end files, then the bfloat16 exactness pass (run beside the pass above)"
cat "$work/background.log"
[ "$rc" -eq 0 ] && [ "$bg" -eq 0 ]
