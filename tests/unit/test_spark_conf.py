"""The suite's Spark jobs compile with C1 only (tests/fixtures/spark_conf.py), through the
administrator's options that Spark puts before a job's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from casque.devstack.jvm import C1_ONLY_FLAGS
from tests.fixtures.spark_conf import use_short_lived_spark


def test_the_drivers_and_executors_of_every_job_started_from_here_get_c1_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    use_short_lived_spark(tmp_path / "conf")
    assert os.environ["SPARK_CONF_DIR"] == str(tmp_path / "conf")
    settings = dict(line.split(" ", 1) for line in (tmp_path / "conf" / "spark-defaults.conf").read_text().splitlines())
    flags = " ".join(C1_ONLY_FLAGS)
    assert settings == {"spark.driver.defaultJavaOptions": flags, "spark.executor.defaultJavaOptions": flags}
    assert [p.name for p in (tmp_path / "conf").iterdir()] == ["spark-defaults.conf"]
