#!/usr/bin/env bash
# The GPU check on a CUDA host that cannot reach a package index: the project's Python dependencies from wheels
# carried in .whl/ (docs/GPU.md says how to fetch them), then the CUDA tests and `specsplit-bench --only gpu`.
# Results: $OUT/gpu.jsonl, $OUT/gpu.md, $OUT/tests.log. On a host with an index, `pip install -e .` and
# `specsplit-bench --only gpu` alone do the same.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/specsplit-gpu}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheels did not install"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 SPECSPLIT_GPU_OUT=$OUT
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep "Model name"; } > "$OUT/env.txt" 2>&1
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/cloud/test_graph_executor.py > "$OUT/tests.log" 2>&1
echo "CUDA tests rc $? ($(tail -1 "$OUT/tests.log"))"
timeout "${BENCH_S:-400}" python3 -m bench.run --only gpu ${GPU_ARGS:-} --out "$OUT/BENCHMARKS.md" > "$OUT/bench.log" 2>&1
echo "bench rc $?"
tail -c 6000 "$OUT/gpu.md" 2>/dev/null || tail -40 "$OUT/bench.log"
