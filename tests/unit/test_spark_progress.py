"""The Spark commands' progress: tasks done over every stage a job ran, and the bar that shows them."""

from __future__ import annotations

import io
import threading
from typing import Any

from rich.console import Console

from casque.spark.progress import StageTasks, rich_progress, stage_progress


def test_stages_that_left_the_active_list_count_as_finished() -> None:
    tasks = StageTasks()
    assert tasks.update({0: (3, 10)}) == (3, 10)
    assert tasks.update({0: (7, 10), 1: (0, 4)}) == (7, 14)
    assert tasks.update({1: (2, 4)}) == (12, 14)  # stage 0 ended between two reads
    assert tasks.update({}) == (14, 14)


def test_the_bar_ends_full_with_every_stage_seen() -> None:
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    reads = iter([{0: (1, 8)}, {0: (8, 8), 1: (2, 6)}])
    polled = threading.Event()

    def read(_: Any) -> dict[int, tuple[int, int]]:
        stages = next(reads, None)
        if stages is None:
            polled.set()
            return {}
        return stages

    with stage_progress(None, console, "stats of default/orders", read=read) as tasks:  # type: ignore[arg-type]
        assert polled.wait(30)
    assert tasks.stages == {0: (8, 8), 1: (6, 6)}
    output = console.file.getvalue()  # type: ignore[attr-defined]
    assert "stats of default/orders (Spark tasks)" in output and "14/14" in output


def test_a_replay_bar_counts_what_the_job_advances() -> None:
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    with rich_progress(console, "default/a -> default/b") as progress:
        progress.start(5)
        progress.advance(2)
        progress.advance(3)
    assert "5/5" in console.file.getvalue()  # type: ignore[attr-defined]
