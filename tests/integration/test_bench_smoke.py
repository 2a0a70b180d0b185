"""Every benchmark in smoke mode (one run, small counts) on the session's Cassandra and ZooKeeper,
through `bench/all.py`, so that none of them rots between the runs that measure.

Only that they run and report every figure as a number is checked: no figure is judged here
(speed goals are ratios the benchmarks print against limits of the same run).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.stack import Backends

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ("engine", "sidecar", "rebalance", "shared", "keys", "latency", "spark", "schema", "filter", "history",
              "pipeline", "scale", "soak")

# The Spark scan starts a local Spark session: it needs what scripts/install-spark.sh caches.
pytestmark = [pytest.mark.integration, pytest.mark.spark]


def test_every_benchmark_runs_in_smoke_mode_and_renders_the_figures_section(
    backends: Backends, tmp_path: Path
) -> None:
    performance = tmp_path / "performance.md"
    shutil.copy(ROOT / "docs" / "performance.md", performance)
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "all.py"), "--smoke", "--out", str(out), "--figures", str(performance),
         "--timeout", "300", "--cassandra", f"{backends.contact_points[0]}:{backends.cql_port}",
         "--zookeeper", backends.zookeeper_hosts],
        capture_output=True, text=True, timeout=1500, check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]

    for name in BENCHMARKS:
        document = json.loads((out / f"{name}.json").read_text())
        assert document["smoke"] is True and document["runs"] == 1
        figures = document["figures"]
        assert figures, f"{name} reported no figures"
        for key, figure in figures.items():
            assert len(figure["values"]) == 1 and math.isfinite(figure["median"]), (name, key, figure)

    section = (out / "figures-section.md").read_text()
    original, updated = (ROOT / "docs" / "performance.md").read_text(), performance.read_text()
    before, _, after = original.partition("<!-- bench:begin -->")
    assert updated.startswith(before) and section in updated
    assert updated.endswith(after.partition("<!-- bench:end -->")[2])
    for name in BENCHMARKS:
        assert f"**{name}**" in section
