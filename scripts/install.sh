#!/usr/bin/env bash
# Installs everything casque needs on a fresh Debian machine, idempotently and cached:
# Java 17, Maven and libfaketime (apt, only if missing), a virtualenv in .venv with the project and its
# pinned dependencies from requirements/dev.lock, every file checked against the lock's hashes
# (the images install requirements/runtime.lock, whose pins dev.lock keeps), then the project
# and the app client in client/ as editable installs (pip, skipped when the locks and the
# pyproject.toml files are unchanged), and the Cassandra and ZooKeeper jars (Maven Central,
# cached under ~/.cache/casque).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
# libfaketime: the clock-skew tests run sidecars with their clocks set off by seconds.
command -v faketime >/dev/null 2>&1 || need_apt+=(faketime)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]} (apt)"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=.venv/.casque-installed
want="$(cat pyproject.toml client/pyproject.toml requirements/dev.lock | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # --no-deps: the lock holds the whole closure (scripts/lock.sh writes it from pyproject.toml).
  .venv/bin/python -m pip install -q --require-hashes --no-deps -r requirements/dev.lock
  # casque requires casque-client, which is not on an index: the local one satisfies it. Both
  # are built with the locked setuptools, nothing fetched; `pip check` proves the lock whole.
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e ./client -e .
  .venv/bin/python -m pip check
  echo "$want" > "$stamp"
fi

# The checkout's sources as bytecode, ahead of their first import: pip compiles what it
# installs, but not the sources of an editable install, and where PYTHONDONTWRITEBYTECODE is
# set (as on the machines this runs on) each process would compile them again: 0.25 s of the
# 1 s of CPU a sidecar spends importing. The tests' and benchmarks' helpers too: the suite
# runs them as processes of their own. Up-to-date files are skipped.
.venv/bin/python -m compileall -q -j 0 casque operator sidecar client/casque_client tests bench
.venv/bin/casque dev install >/dev/null
echo "casque installed: $(pwd)/.venv/bin/casque"
