"""Where a running sidecar's memory is, on demand: SIGUSR2 writes a report.

A sidecar runs in every pod, so memory that grows with time shows in production after hours,
not in a test: the report has to come from the process as it runs, without a restart or a
debugger attached. On SIGUSR2 the sidecar logs its RSS and its live Python objects by type
(the most numerous). Started with `CASQUE_SIDECAR_MEMORY_TRACE_FRAMES` above 0, it also
traces allocations (tracemalloc: CPU and memory on every allocation, so for diagnosis, not
for normal running) and each SIGUSR2 writes a snapshot to `CASQUE_SIDECAR_MEMORY_SNAPSHOT_DIR`;
`casque memory-growth BEFORE AFTER` names the source lines whose live allocations grew
between two of them.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import pickle
import resource
import tempfile
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from casque.errors import CasqueError

log = logging.getLogger(__name__)

# Types named in a report: the rest are summed in its total.
CENSUS_TYPES = 15
SNAPSHOT_SUFFIX = ".tracemalloc"
# Allocations of the tracing itself, and of importing (which only grows once), are noise.
_NOISE = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
          tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"), tracemalloc.Filter(False, "<unknown>"))


class NotASnapshot(CasqueError):
    """A file given as a snapshot is not one tracemalloc wrote."""

    code = "not_a_snapshot"


@dataclass(frozen=True)
class LineGrowth:
    """One source line's live allocations, grown (or shrunk) between two snapshots."""

    where: str
    size_bytes: int
    size_change_bytes: int
    count_change: int

    def line(self) -> str:
        """One line of a growth listing: the change, then where, then what lives there now."""
        return (f"{self.size_change_bytes / 1024:+10.1f} KiB {self.count_change:+9d} blocks  {self.where}"
                f" (now {self.size_bytes / 1024:.1f} KiB)")


def start_tracing(frames: int) -> None:
    """Trace every allocation from now on, keeping `frames` frames of its stack (0: off)."""
    if frames > 0:
        tracemalloc.start(frames)


def object_census(top: int = CENSUS_TYPES) -> tuple[int, list[tuple[str, int]]]:
    """The objects the cycle collector tracks (containers, which hold the rest), in all,
    and the `top` most numerous types with their counts. What the sidecar made while it
    started is frozen out of the collector's generations (heap.settle) and so out of this
    count: what is counted was made since, which is where a leak shows. Walks every object:
    for a signal, not for a request path."""
    counts = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    return sum(counts.values()), counts.most_common(top)


def rss_bytes() -> int:
    """The process's resident set now (its peak where /proc is missing)."""
    try:
        with open(f"/proc/{os.getpid()}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryReports:
    """The reports of one process: numbered, so that its snapshots sort in the order taken."""

    def __init__(self, snapshot_dir: Path | None) -> None:
        self._snapshot_dir = snapshot_dir
        self._numbers = itertools.count(1)

    def report(self) -> Path | None:
        """Log RSS and the object census; with tracing on, write a snapshot and return its path."""
        number = next(self._numbers)
        resident = rss_bytes()
        objects, census = object_census()
        tracing = tracemalloc.is_tracing()
        traced = tracemalloc.get_traced_memory()[0] if tracing else None
        snapshot = self._write_snapshot(number) if tracing else None
        log.info("memory report %d: RSS %.1f MiB, %d tracked objects, most numerous: %s%s%s", number,
                 resident / 2**20, objects, ", ".join(f"{name} {count}" for name, count in census),
                 "" if traced is None else f"; allocations traced: {traced / 2**20:.1f} MiB",
                 "" if snapshot is None else f", snapshot {snapshot}",
                 extra={"rss_bytes": resident, "objects": objects, "census": dict(census),
                        "traced_bytes": traced, "snapshot": None if snapshot is None else str(snapshot)})
        return snapshot

    def _write_snapshot(self, number: int) -> Path | None:
        directory = self._snapshot_dir or Path(tempfile.gettempdir())
        path = directory / f"casque-sidecar-{os.getpid()}-{number:04d}{SNAPSHOT_SUFFIX}"
        partial = path.with_name(path.name + ".partial")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tracemalloc.take_snapshot().filter_traces(_NOISE).dump(str(partial))
            partial.replace(path)  # whole or not at all, for whoever waits for the file
        except OSError as error:
            # A full or read-only disk must not end the process the report is about.
            log.warning("memory report %d: the snapshot could not be written to %s: %s", number, path, error)
            return None
        return path


def growth(before: Path, after: Path, top: int = 20) -> list[LineGrowth]:
    """The `top` source lines whose live allocations grew most from `before` to `after`
    (snapshots of one process), largest growth first."""
    old, new = _load(before), _load(after)
    grown = sorted(new.compare_to(old, "lineno"), key=lambda stat: stat.size_diff, reverse=True)
    return [LineGrowth(str(stat.traceback[0]), stat.size, stat.size_diff, stat.count_diff) for stat in grown[:top]]


def _load(path: Path) -> tracemalloc.Snapshot:
    try:
        snapshot = tracemalloc.Snapshot.load(str(path))
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, IndexError, TypeError,
            ValueError) as error:
        raise NotASnapshot(f"{path} is not a memory snapshot: {error}") from error
    if not isinstance(snapshot, tracemalloc.Snapshot):
        raise NotASnapshot(f"{path} is not a memory snapshot")
    return snapshot
