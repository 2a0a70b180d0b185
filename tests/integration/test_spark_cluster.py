"""The Spark jobs on a real standalone cluster: `casque spark stats | export | replay` run as
a user runs them, with `--master spark://...`, against a master and a worker started from the
installed PySpark (tests.fixtures.spark_cluster), and checked against the same expectations
as the local-mode tests (computed with the Python driver from the same rows).

Each command runs in its own process, as from a terminal: the driver runs there (client
mode), the executors on the worker, which fetch the connector jars from the driver
(`spark.jars`, or spark-submit's `--jars`). Export runs under spark-submit, the way a
Kubernetes user starts it; stats and replay as `casque spark ... --master spark://...`. Every command must show up at the master as a finished application, so a
job that silently fell back to local mode fails.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cassandra.cluster import Session

import casque.cli
from casque.engine import catalog
from casque.spark import replay
from casque.spark.jars import local_jars
from casque.specs import QueueSpec
from casque.store import Store
from tests.fixtures.spark_cluster import SparkCluster, spark_cluster, spark_home  # noqa: F401
from tests.integration.test_spark import (  # noqa: F401
    SOURCE,
    TARGET,
    History,
    _ack_some,
    _check_message,
    _driver_rows,
    _expected_stats,
    _target_messages,
    env,
    history,
)

# A job's own guard (JOB_TIMEOUT) stays below the test's, so a slow job on a loaded machine
# fails with its output rather than with pytest-timeout's stack dump.
JOB_TIMEOUT = 1200
pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.timeout(JOB_TIMEOUT + 600)]

# The `casque` command as a script file, which spark-submit runs as the driver's program.
CLI_SCRIPT = Path(casque.cli.__file__).with_name("__main__.py")


def on_cluster(cluster: SparkCluster, environment: dict[str, str], *args: str, submit: bool = False) -> str:
    """Run `casque spark ARGS` against the cluster (with --master, or under spark-submit);
    its output. Asserts that it ran there: an application finished at the master."""
    before = len(cluster.completed_apps())
    # One executor with the worker's cores; the driver's UI is of no use here.
    settings = ["--conf", "spark.executor.memory=768m", "--conf", "spark.ui.enabled=false"]
    if submit:
        # As on Kubernetes: spark-submit owns the driver's JVM, so it gets the master and the
        # connector jars; the job takes its master from there.
        jars = ",".join(str(jar) for jar in local_jars() or [])
        assert jars, "run scripts/install-spark.sh"
        command = [str(spark_home() / "bin" / "spark-submit"), "--master", cluster.url, "--jars", jars, *settings,
                   str(CLI_SCRIPT), "spark", *args]
    else:
        command = [sys.executable, "-m", "casque.cli", "spark", *args, "--master", cluster.url,
                   "--connector", "local", *settings]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=JOB_TIMEOUT,
        env={**os.environ, **environment, "COLUMNS": "200",
             # spark-submit's driver: this interpreter, with casque and its packages.
             "PYSPARK_DRIVER_PYTHON": sys.executable, "PYSPARK_PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    finished = cluster.completed_apps()[before:]
    assert finished, f"no application finished at the master: {cluster.master_state()}"
    return done.stdout


def test_stats_on_the_cluster_match_the_driver(
    spark_cluster: SparkCluster, store: Store, cql: Session, history: History, env: dict[str, str], tmp_path: Path  # noqa: F811
) -> None:
    acked = _ack_some(store, history)
    want = _expected_stats(_driver_rows(cql, store, SOURCE))
    on_cluster(spark_cluster, env, "stats", "--queue", SOURCE.name, "--out", str(tmp_path / "stats"))
    out = tmp_path / "stats"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["messages"] == want["messages"] == len(history.messages)
    assert summary["bytes"] == want["bytes"]
    per_minute = json.loads((out / "per_minute.json").read_text())
    assert {r["minute"]: (r["messages"], r["bytes"]) for r in per_minute} == want["per_minute"]
    shards = json.loads((out / "shards.json").read_text())
    assert {r["shard"]: r["messages"] for r in shards} == want["per_shard"]
    sizes = json.loads((out / "sizes.json").read_text())
    assert {r["bin"]: r["messages"] for r in sizes if r["messages"]} == want["bins"]
    latency = json.loads((out / "latency.json").read_text())
    assert {r["subscriber"]: r["acked"] for r in latency} == acked
    # The Parquet tables were written by the executor, next to the driver's JSON.
    assert (out / "parquet" / "per_minute" / "_SUCCESS").exists()
    assert (out / "report.html").exists()


def test_export_under_spark_submit_round_trips_every_message(
    spark_cluster: SparkCluster, store: Store, history: History, env: dict[str, str], tmp_path: Path  # noqa: F811
) -> None:
    start = history.start + timedelta(minutes=1)
    since = start.isoformat().replace("+00:00", "Z")
    on_cluster(spark_cluster, env, "export", "--queue", SOURCE.name, "--from", since, "--format", "jsonl",
               "--out", str(tmp_path / "export"), submit=True)
    expected = {m.message_id: m for m in history.messages if m.published_at >= start}
    seen: list[tuple[int, int, int]] = []
    for part in sorted((tmp_path / "export" / "messages").glob("part-*.json")):
        for line in part.read_text(encoding="utf-8").splitlines():
            got: dict[str, Any] = json.loads(line)
            _check_message(expected[got["message_id"]], got, base64.b64decode(got["payload_base64"], validate=True))
            seen.append((got["shard"], got["batch"], got["seq"]))
    assert seen == sorted(seen) and len(seen) == len(set(seen)) == len(expected)
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["messages"] == len(expected)


def test_replay_on_the_cluster_delivers_the_range_exactly_once(
    spark_cluster: SparkCluster, store: Store, cql: Session, history: History, env: dict[str, str]  # noqa: F811
) -> None:
    catalog.apply_queue(store, TARGET, QueueSpec(shards=3, retention_seconds=3600, consistency="ONE"))
    selected = [m for m in history.messages if m.shard in (1, 1001)]
    output = on_cluster(spark_cluster, env, "replay", "--queue", SOURCE.name, "--range", "1:1-,1001:1-",
                        "--into", TARGET.name)
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["selected"] == summary["published"] == len(selected), output
    rows = _target_messages(cql, store)
    assert sorted(r.client_id for r in rows) == sorted(
        replay.client_id(SOURCE, m.shard, m.batch, m.seq) for m in selected)
    by_client = {r.client_id: r for r in rows}
    for m in selected:
        row = by_client[replay.client_id(SOURCE, m.shard, m.batch, m.seq)]
        assert (row.payload or b"") == m.message.payload and row.key == m.message.key
