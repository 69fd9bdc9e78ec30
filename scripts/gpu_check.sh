#!/usr/bin/env bash
# The GPU check on a CUDA host that cannot reach a package index: the project's Python dependencies from wheels
# carried in .whl/ (docs/GPU.md says how to fetch them), then the CUDA tests (the verify rule on the device, the graph
# executor's start-up capture of the shipped default, the paged-attention kernel compiled), `specsplit-bench --only
# gpu` (the forward by shape and path) and `--only gpu-capacity` (tokens per GPU-second with the coder pair's
# replayed drafts against cloud_only). About 12 minutes in all. Results: $OUT/gpu.jsonl, $OUT/gpu.md,
# $OUT/tests.log, $OUT/capacity.log, bench/results/forward_costs_cuda.json, bench/plots/gpu_capacity_cuda.png.
# On a host with an index, `pip install -e .` and the two bench commands alone do the same.
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
timeout "${TESTS_S:-180}" python3 -m pytest -q -p no:cacheprovider tests/shared/test_target_probs.py \
  tests/cloud/test_graph_executor.py tests/cloud/test_paged_kernel.py > "$OUT/tests.log" 2>&1
echo "CUDA tests rc $? ($(tail -1 "$OUT/tests.log"))"
# the executor's paths only (transformers' own forward was measured on the H200 on 2026-11-28, BENCHMARKS.md), so the
# fused kernels' path fits the same time
timeout "${BENCH_S:-400}" python3 -m bench.run --only gpu \
  ${GPU_ARGS:---gpu-paths graphs,graphs-invariant,graphs-triton-invariant,graphs-fused-invariant} \
  --out "$OUT/BENCHMARKS.md" > "$OUT/bench.log" 2>&1
echo "bench rc $?"
timeout "${CAPACITY_S:-300}" python3 -m bench.run --only gpu-capacity --gpu-shapes coder-1.5b \
  --out "$OUT/BENCHMARKS.md" > "$OUT/capacity.log" 2>&1
echo "capacity rc $?"
cp bench/results/forward_costs_cuda.json bench/plots/gpu_capacity_cuda.png "$OUT/" 2>/dev/null
tail -30 "$OUT/capacity.log"
tail -c 6000 "$OUT/gpu.md" 2>/dev/null || tail -40 "$OUT/bench.log"
