#!/usr/bin/env bash
# Install Prometheus (server and promtool) from Debian's packages when missing: the ops tests check
# deploy/prometheus/ with promtool and run a real Prometheus as an unprivileged child scraping the
# cloud and the edge on loopback (the system service is not used). sudo only when not root.
set -euo pipefail
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "installing prometheus (apt-get)..." >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
