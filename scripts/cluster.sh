#!/usr/bin/env bash
# A local cluster without Docker: N verifier replicas and nginx on 127.0.0.1, nginx hashing the
# routing key (X-Specsplit-Route) so each generation stays on one replica and fails over exactly.
#   bash scripts/cluster.sh [N=3] [--http-port 8000] [--grpc-port 50051] [--model DIR] [-- CLOUD FLAGS]
# Prints the balancer's URLs; Ctrl-C stops everything (replicas drain first).
# Installs nginx from Debian's packages if it is missing, and the project's .venv if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_nginx.sh
[ -x .venv/bin/specsplit-cloud ] || bash scripts/setup.sh
exec .venv/bin/python -m bench.cluster "$@"
