#!/usr/bin/env bash
# casque's figures, in one command: every benchmark (bench/all.py), each figure the median
# of 3 runs with its spread, written into docs/performance.md's benchmark section.
#
# Uses the local stack, started here if it is not running (`casque dev up`, ports 9042 and
# 2181). CASQUE_BENCH_CASSANDRA=host:port and CASQUE_BENCH_ZOOKEEPER=host:port point it at
# servers that already run instead. Extra arguments go to bench/all.py (--runs, --only,
# --smoke, --out).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${CASQUE_BENCH_CASSANDRA:-}" ] || [ -z "${CASQUE_BENCH_ZOOKEEPER:-}" ]; then
  .venv/bin/casque dev up
fi
exec .venv/bin/python bench/all.py --figures docs/performance.md "$@"
