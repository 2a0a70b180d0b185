#!/usr/bin/env bash
# Prepares the Spark jobs (`casque spark ...`) and their tests, idempotently and cached:
# copies the Spark Cassandra Connector and its runtime dependencies from Maven Central into
# ~/.cache/casque/spark-jars/<version>/ (skipped when an earlier run completed), then starts
# one local Spark session on those jars to prove the connector loads (also once). After this,
# no Spark job or test downloads anything.
#
# Needs what scripts/install.sh installs first: Java 17, Maven, and .venv with the `dev` (or
# `spark`) extra, which brings PySpark. PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-.venv/bin/python}
if ! "$python" -c "import pyspark" 2>/dev/null; then
  echo "install-spark: PySpark is missing from $python; run scripts/install.sh first" >&2
  exit 1
fi
"$python" -m casque.spark.jars --check
