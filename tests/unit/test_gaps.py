"""The pure gap logic (casque.engine.gaps): the next batch that exists, whatever expired first."""

from __future__ import annotations

import asyncio

import pytest

from casque.engine.gaps import bucket_slices, first_existing, holes


def probe_of(live: set[int], reads: list[tuple[int, int]] | None = None):  # type: ignore[no-untyped-def]
    """A probe over a log whose existing batches are `live`, recording the slices it reads."""

    async def probe(low: int, high: int) -> int | None:
        if reads is not None:
            reads.append((low, high))
        await asyncio.sleep(0)
        return min((b for b in live if low <= b < high), default=None)

    return probe


def test_slices_cut_at_bucket_boundaries() -> None:
    assert bucket_slices(3, 3, 4) == []
    assert bucket_slices(3, 4, 4) == [(3, 4)]
    assert bucket_slices(3, 13, 4) == [(3, 4), (4, 8), (8, 12), (12, 13)]
    assert bucket_slices(4, 8, 4) == [(4, 8)]


@pytest.mark.parametrize("at_once", [1, 3, 8])
async def test_newer_batches_expired_before_older_ones_are_crossed(at_once: int) -> None:
    # A lowered retention: 1..40 live (old TTL), 41..150 expired (new, short TTL), 151..160 live.
    # A reader at 41 must land on 151; bisection over 1..160 lands on 1 (the old prefix lives).
    live = set(range(1, 41)) | set(range(151, 161))
    reads: list[tuple[int, int]] = []
    assert await first_existing(41, 161, probe_of(live, reads), at_once=at_once, per_bucket=64) == 151
    assert (41, 64) in reads and (128, 161) in reads


async def test_a_live_batch_inside_an_expired_stretch_is_never_passed() -> None:
    # Several retention changes: expired runs with live runs between them, in any order.
    live = {70, 71, 300}
    assert await first_existing(2, 400, probe_of(live), at_once=4, per_bucket=64) == 70
    assert await first_existing(72, 400, probe_of(live), at_once=4, per_bucket=64) == 300
    assert await first_existing(2, 70, probe_of(live), at_once=4, per_bucket=64) is None


async def test_every_bucket_before_the_answer_is_read_and_none_after_its_window() -> None:
    reads: list[tuple[int, int]] = []
    assert await first_existing(0, 64 * 20, probe_of({64 * 9 + 5}, reads), at_once=4, per_bucket=64) == 64 * 9 + 5
    assert sorted(reads) == [(64 * b, 64 * (b + 1)) for b in range(12)]  # three windows of four


async def test_the_earliest_window_hit_wins_over_later_ones_read_alongside() -> None:
    # Probes of one window run together; the answer is the first bucket's, not the fastest's.
    live = {10, 200}
    assert await first_existing(5, 256, probe_of(live), at_once=4, per_bucket=64) == 10


def test_holes_of_a_read_lie_before_and_between_its_batches() -> None:
    assert holes(5, []) == []
    assert holes(5, [5, 6, 7]) == []
    assert holes(5, [9, 10]) == [(5, 9)]
    # A read from 64 that returned 64-70 and then 101: 71-100 must be proven gone too.
    assert holes(64, [64, 65, 70, 101, 102, 110]) == [(66, 70), (71, 101), (103, 110)]
