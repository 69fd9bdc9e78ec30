#!/usr/bin/env bash
# Install nginx from Debian's packages when it is missing (the replica tests and scripts/cluster.sh
# run a stock nginx as an unprivileged child; the system service is not used). sudo only when not root.
set -euo pipefail
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "installing nginx (apt-get)..." >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx >/dev/null
