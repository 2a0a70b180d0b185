"""memory_report: what a SIGUSR2 report holds, and the growth between two snapshots."""

from __future__ import annotations

import logging
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from casque.sidecar.memory_report import SNAPSHOT_SUFFIX, MemoryReports, NotASnapshot, growth, object_census

KEPT: list[bytearray] = []


class Marker:
    """A type of this test's own, to find in the census."""


@pytest.fixture
def tracing() -> Iterator[None]:
    tracemalloc.start(1)
    yield
    tracemalloc.stop()
    KEPT.clear()


def keep(count: int) -> None:
    KEPT.extend(bytearray(4096) for _ in range(count))  # the line the growth must name


def test_the_census_counts_live_objects_by_type_most_numerous_first() -> None:
    markers = [Marker() for _ in range(12_345)]
    total, census = object_census(top=10_000)
    assert dict(census)[f"{__name__}.Marker"] == 12_345
    assert [count for _, count in census] == sorted((count for _, count in census), reverse=True)
    assert total >= sum(count for _, count in census) >= len(markers)
    assert len(object_census(top=3)[1]) == 3


@pytest.mark.usefixtures("tracing")
def test_growth_names_the_line_whose_allocations_grew(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reports = MemoryReports(tmp_path / "made-on-demand")
    caplog.set_level(logging.INFO, "casque.sidecar.memory_report")
    before = reports.report()
    keep(500)
    after = reports.report()
    assert before is not None and after is not None
    assert [before.name.endswith(f"-0001{SNAPSHOT_SUFFIX}"), after.name.endswith(f"-0002{SNAPSHOT_SUFFIX}")] == [True, True]
    assert not list(before.parent.glob("*.partial"))  # written whole, then renamed
    top = growth(before, after, top=1)[0]
    assert top.where.endswith(f"test_memory_report.py:{keep.__code__.co_firstlineno + 1}")
    assert top.size_change_bytes >= 500 * 4096
    assert top.count_change >= 500
    assert "memory report 2: RSS" in caplog.text and str(after) in caplog.text


def test_without_tracing_a_report_logs_the_census_and_writes_no_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "casque.sidecar.memory_report")
    assert MemoryReports(tmp_path).report() is None
    assert not list(tmp_path.iterdir())
    (record,) = caplog.records
    assert record.objects > 0 and record.rss_bytes > 0 and record.snapshot is None  # type: ignore[attr-defined]


@pytest.mark.usefixtures("tracing")
def test_a_snapshot_that_cannot_be_written_is_logged_and_the_report_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "casque.sidecar.memory_report")
    blocked = tmp_path / "a-file-not-a-directory"
    blocked.write_text("")
    assert MemoryReports(blocked).report() is None
    assert "could not be written" in caplog.text
    assert "memory report 1: RSS" in caplog.text


def test_a_file_that_is_not_a_snapshot_is_refused_in_one_line(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("not a snapshot")
    with pytest.raises(NotASnapshot, match="is not a memory snapshot"):
        growth(other, other)
    command = subprocess.run([sys.executable, "-m", "casque.cli", "memory-growth", str(other), str(other)],
                             capture_output=True, text=True, timeout=120)
    assert command.returncode == 1
    assert command.stderr.strip().splitlines() == [f"casque: {other} is not a memory snapshot: {_load_error(other)}"]


def _load_error(path: Path) -> str:
    try:
        tracemalloc.Snapshot.load(str(path))
    except Exception as error:  # noqa: BLE001 - whatever the loader says is what the line repeats
        return str(error)
    raise AssertionError("loaded")
