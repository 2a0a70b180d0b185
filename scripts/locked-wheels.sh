#!/usr/bin/env bash
# The locked wheels an image build installs (requirements/build.lock, runtime.lock and the
# sidecar's tracing.lock of the source tree given, this checkout's by default), downloaded once
# with their hashes checked into ${CASQUE_CACHE:-~/.cache/casque}/images/wheels/<hash of the
# locks>/, beside a pip.conf that points pip at them and at no index. The image builds mount
# that folder as /etc/xdg/pip and run with no network: nothing is fetched at test time.
# scripts/install-podman.sh calls it for this checkout, scripts/install-releases.sh for each
# previous release's source (its images are built from its own locks).
#
#   bash scripts/locked-wheels.sh [SOURCE_TREE]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
python=$(realpath "$python" 2>/dev/null || command -v "$python")
source_tree=${1:-.}
cache="${CASQUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/casque}/images/wheels"
cd "$source_tree"
locks=(requirements/build.lock requirements/runtime.lock requirements/tracing.lock)
wheels="$cache/$(cat "${locks[@]}" | sha256sum | cut -c1-16)"
mkdir -p "$cache"
if [ ! -f "$wheels/pip.conf" ]; then
  rm -rf "$wheels.partial"
  # The images' Python, whatever the host's: only wheels, for CPython 3.11 on this platform.
  "$python" -m pip download -q --require-hashes --no-deps --only-binary=:all: --python-version 3.11 \
    --dest "$wheels.partial" "${locks[@]/#/-r}"
  printf '[global]\nno-index = true\nfind-links = /etc/xdg/pip\n' >"$wheels.partial/pip.conf"
  rm -rf "$wheels"
  mv "$wheels.partial" "$wheels"
  echo "locked wheels in $wheels"
fi
# Other folders hold the wheels of other checkouts' locks and of releases: keep the six used
# last, so that checkouts on one machine do not take each other's away, and drop the rest.
touch "$wheels"
ls -1dt "$cache"/*/ | tail -n +7 | xargs -r rm -rf
