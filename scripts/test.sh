#!/usr/bin/env bash
# The README's test command: install what is needed, then run the whole test suite.
# Extra arguments go to pytest (e.g. bash scripts/test.sh tests/shared -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,bench
bash scripts/install_nginx.sh   # the replica tests run a real nginx
bash scripts/install_prometheus.sh   # the ops tests run promtool and a real Prometheus
exec .venv/bin/python -m pytest -q --durations=25 "$@"
