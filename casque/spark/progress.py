"""Progress bars of the Spark commands on the terminal (rich), on stderr beside their output.

- `stage_progress`: the tasks of the Spark stages a job runs (stats, export), read from
  Spark's status tracker while the job runs. Spark plans stages one after another, so the
  total grows as stages start; a stage that has left the active list counts as finished.
- `rich_progress`: a count the job advances itself (replay: messages published).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from rich.console import Console

# How often the status tracker is read while a job runs.
POLL_SECONDS = 0.5


class Progress(Protocol):
    def start(self, total: int) -> None: ...

    def advance(self, count: int) -> None: ...


@dataclass
class StageTasks:
    """Tasks done and in all, over every stage seen so far."""

    stages: dict[int, tuple[int, int]] = field(default_factory=dict)  # stage -> (done, tasks)

    def update(self, active: dict[int, tuple[int, int]]) -> tuple[int, int]:
        """Fold in the stages active now; those no longer active are finished. (done, total)."""
        for stage, (_, tasks) in self.stages.items():
            if stage not in active:
                self.stages[stage] = (tasks, tasks)
        self.stages.update(active)
        return sum(done for done, _ in self.stages.values()), sum(tasks for _, tasks in self.stages.values())


def active_stages(spark: SparkSession) -> dict[int, tuple[int, int]]:
    """(completed tasks, tasks) of each stage Spark runs now."""
    tracker = spark.sparkContext.statusTracker()
    stages: dict[int, tuple[int, int]] = {}
    for stage in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage)
        if info is not None:
            stages[stage] = (info.numCompletedTasks, info.numTasks)
    return stages


def _bar(console: Console, description: str, remaining: bool) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress as Bar,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns: list[Any] = [TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    if remaining:
        columns.append(TimeRemainingColumn())
    return Bar(*columns, console=console, transient=False)


@contextmanager
def stage_progress(
    spark: SparkSession, console: Console, description: str,
    read: Callable[[SparkSession], dict[int, tuple[int, int]]] = active_stages,
) -> Iterator[StageTasks]:
    """A bar of Spark tasks done while the block runs its jobs; ends full when the block does."""
    tasks = StageTasks()
    bar = _bar(console, f"{description} (Spark tasks)", remaining=False)
    stopped = threading.Event()
    with bar:
        task = bar.add_task(description, total=None)

        def refresh() -> None:
            done, total = tasks.update(read(spark))
            bar.update(task, completed=done, total=total or None)

        def poll() -> None:
            while not stopped.wait(POLL_SECONDS):
                refresh()

        poller = threading.Thread(target=poll, name="casque-spark-progress", daemon=True)
        poller.start()
        try:
            yield tasks
        finally:
            stopped.set()
            poller.join()
        refresh()  # nothing runs any more: every stage seen is finished


@contextmanager
def rich_progress(console: Console, description: str) -> Iterator[Progress]:
    """A bar on `console` of a count the job advances itself (replay: messages published)."""
    bar = _bar(console, description, remaining=True)

    class _Adapter:
        task: Any = None

        def start(self, total: int) -> None:
            self.task = bar.add_task(description, total=total)

        def advance(self, count: int) -> None:
            if self.task is not None:
                bar.advance(self.task, count)

    with bar:
        yield _Adapter()
