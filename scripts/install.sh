#!/usr/bin/env bash
# Installs everything casque needs on a fresh Debian machine, idempotently and cached:
# Java 17 and Maven (apt, only if missing), a virtualenv in .venv with the project and its
# pinned dependencies, the app client in client/ included (pip, skipped when the
# pyproject.toml files are unchanged), and the Cassandra and
# ZooKeeper jars (Maven Central, cached under ~/.cache/casque).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
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
want="$(cat pyproject.toml client/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # casque requires casque-client, which is not on an index: the local one satisfies it.
  .venv/bin/python -m pip install -q -e ./client -e '.[dev]'
  echo "$want" > "$stamp"
fi

.venv/bin/casque dev install >/dev/null
echo "casque installed: $(pwd)/.venv/bin/casque"
