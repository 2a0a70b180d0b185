#!/usr/bin/env bash
# Command 2 of the README: install everything, then run the whole test suite against real
# servers that the tests start themselves (Cassandra, ZooKeeper, kube-apiserver with etcd,
# Spark in local mode).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install-kube-tools.sh
bash scripts/install-spark.sh
exec .venv/bin/python -m pytest "$@"
