"""Gaps in a shard's log: batches that a read did not return although later ones exist.

Batches are contiguous (a writer claims N only after it knows N-1 exists), so a batch
missing below a live one, or below the head, was written and has expired, or a read at a
weak consistency missed it on a lagging replica. Nothing here assumes which batches expire
first: a table's TTL applies only to rows written after it changed, so after a lowered
retention newer batches expire before older ones, after a raised one older ones go first,
and a message's own TTL shortens only its rows. So a gap is never inferred from either end
or found by bisection: every bucket it spans is read, and a batch is passed over only once
a read that cannot miss it says it is gone.

That read is SERIAL (LOCAL_SERIAL where claims use it, `Log.first_header`): every batch is
written by a Paxos round in its own partition, and a serial read completes any round in
progress and reads from a quorum, so it sees every batch its partition ever got whatever
the read consistency of the queue and however far one replica lags. One serial read per
bucket (64 batches) of the gap, a few at a time; gaps come only from expiry, so this is
paid once per gap, not per read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from casque.engine.batches import Batch, Log
from casque.errors import BackendUnavailable
from casque.schema import BATCHES_PER_BUCKET

# Buckets of a gap read at once.
PROBES_AT_ONCE = 8

# (low, high) -> the first batch in [low, high) that exists, or None; low..high-1 lie in one bucket.
Probe = Callable[[int, int], Awaitable[int | None]]


def bucket_slices(first: int, end: int, per_bucket: int = BATCHES_PER_BUCKET) -> list[tuple[int, int]]:
    """[first, end) cut at bucket boundaries: (low, high) pairs in order."""
    slices = []
    low = first
    while low < end:
        high = min(end, (low // per_bucket + 1) * per_bucket)
        slices.append((low, high))
        low = high
    return slices


async def first_existing(first: int, end: int, probe: Probe, at_once: int = PROBES_AT_ONCE,
                         per_bucket: int = BATCHES_PER_BUCKET) -> int | None:
    """The first batch in [first, end) that `probe` finds, reading every bucket before it; None
    when none of them exists."""
    slices = bucket_slices(first, end, per_bucket)
    for start in range(0, len(slices), at_once):
        window = slices[start:start + at_once]
        found = await asyncio.gather(*(probe(low, high) for low, high in window))
        for batch in found:
            if batch is not None:
                return batch
    return None


async def next_live(log: Log, shard: int, first: int, end: int) -> int:
    """The first batch of [first, end) that exists (read at SERIAL), or `end` if all are gone."""
    found = await first_existing(first, end, lambda low, high: log.first_header(shard, low, high))
    return end if found is None else found


async def prove_gone(log: Log, shard: int, first: int, found: int) -> None:
    """Batches first..found-1 were not read but `found` was: return once every one of them is
    known to be gone; raise if one exists after all (the read missed it: read again)."""
    live = await next_live(log, shard, first, found)
    if live < found:
        raise BackendUnavailable(f"shard {shard}: batch {live} exists but the read did not return it")


def holes(first: int, numbers: Iterable[int]) -> list[tuple[int, int]]:
    """The ranges [low, high) missing from a read from `first` that returned batches `numbers`
    (rising): before the first one and between any two."""
    missing = []
    expected = first
    for number in numbers:
        if number > expected:
            missing.append((expected, number))
        expected = number + 1
    return missing


async def prove_read(log: Log, shard: int, first: int, batches: list[Batch]) -> list[tuple[int, int]]:
    """The holes in a read from `first`, each proven gone (or BackendUnavailable: read again).
    A read returns whatever exists from `first` on, so a hole can sit between two batches."""
    missing = holes(first, [b.header.batch for b in batches])
    await asyncio.gather(*(prove_gone(log, shard, low, high) for low, high in missing))
    return missing


async def read_range(log: Log, shard: int, start: int, end: int) -> list[Batch]:
    """The batches of [start, end) that exist; the ones missing are proven gone."""
    batches: list[Batch] = []
    first = start
    while first < end:
        got = [b for b in await log.read_from(shard, first) if b.header.batch < end]
        if not got:
            live = await next_live(log, shard, first, end)  # first..live-1 are gone
            if live == first:
                raise BackendUnavailable(f"shard {shard}: batch {first} exists but the read did not return it")
            first = live
            continue
        await prove_read(log, shard, first, got)
        batches.extend(got)
        first = got[-1].header.batch + 1
    return batches
