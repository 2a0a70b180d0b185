"""Ranges of a queue's history: what the Spark jobs read, written once and resolved to partitions.

Syntax (one expression, terms separated by commas):

    TIME..TIME            a time window, [from, to): RFC3339 times, either side may be empty
    SHARD:FIRST-LAST      batches FIRST to LAST of one shard, both inclusive, either may be empty
                          (SHARD as stored: priority level x 1000 + shard, so 0..N-1 at level 0)
    *:FIRST-LAST          the same batches of every shard

    2026-11-22T10:00:00Z..2026-11-22T11:00:00Z      one hour, every shard
    0:1-500,1:1-480                                 two shards, by batch number
    *:100-,2026-11-22T10:00:00Z..                   batches from 100 on, published from 10:00

Batch terms of the same shard add up; shards no batch term names are left out (unless a
`*` term names them all). A time window narrows whatever the batch terms select. An empty
expression is the whole retained history.

Resolving a range reads the heads (every batch <= head exists) and, for time bounds, finds
the first batch at a time by binary search over batch headers: O(log n) point reads per
shard. The result is, per shard, a list of batch intervals, and from them the (shard,
bucket) partitions to read: a job never scans the table, only those partitions. Times are
exact to within the clock skew between publishers (batch headers of one shard are in
publish order up to that skew); the jobs also filter rows by their publish time, so a row
outside a time window is never included.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from casque.engine import catalog, positions
from casque.instants import in_utc, rfc3339
from casque.schema import QueueRef, bucket_of
from casque.spark.errors import InvalidRange
from casque.store import Store

_BATCHES = re.compile(r"^(?P<shard>\*|\d+):(?P<first>\d*)-(?P<last>\d*)$")
# RFC3339 with a required offset; fractions of a second allowed.
_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$"
)


def parse_time(text: str) -> datetime:
    """An RFC3339 time such as 2026-11-22T10:00:00Z or 2026-11-22T11:00:00.5+01:00, in UTC."""
    value = text.strip()
    if not _RFC3339.fullmatch(value):
        raise InvalidRange(f"{text!r} is not an RFC3339 time (e.g. 2026-11-22T10:00:00Z)")
    try:
        # Python 3.11 reads RFC3339 whole (Z, offsets, any number of fractional digits).
        return in_utc(datetime.fromisoformat(value.upper().replace(" ", "T")))
    except ValueError as error:
        raise InvalidRange(f"{text!r} is not a valid time: {error}") from None


def format_time(moment: datetime) -> str:
    return rfc3339(moment)


@dataclass(frozen=True)
class BatchTerm:
    """Batches first..last (inclusive) of one shard, or of every shard when shard is None."""

    shard: int | None
    first: int | None = None
    last: int | None = None

    def __str__(self) -> str:
        shard = "*" if self.shard is None else str(self.shard)
        return f"{shard}:{self.first or ''}-{self.last or ''}"


@dataclass(frozen=True)
class RangeSpec:
    since: datetime | None = None
    until: datetime | None = None
    batches: tuple[BatchTerm, ...] = ()

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise InvalidRange(f"the time window is empty: {format_time(self.since)} is not before "
                               f"{format_time(self.until)}")

    def with_times(self, since: datetime | None, until: datetime | None) -> RangeSpec:
        """This range narrowed by --since/--until (or --from/--to)."""
        if (since is not None and self.since is not None) or (until is not None and self.until is not None):
            raise InvalidRange("give the time window once: in the range or with the time options")
        return RangeSpec(since or self.since, until or self.until, self.batches)

    def __str__(self) -> str:
        terms = [str(t) for t in self.batches]
        if self.since is not None or self.until is not None:
            since = format_time(self.since) if self.since else ""
            until = format_time(self.until) if self.until else ""
            terms.append(f"{since}..{until}")
        return ",".join(terms) or "all"


def parse_range(text: str | None) -> RangeSpec:
    """Parse the range syntax of this module's docstring."""
    if text is None or not text.strip() or text.strip() == "all":
        return RangeSpec()
    since: datetime | None = None
    until: datetime | None = None
    windows = 0
    batches: list[BatchTerm] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            raise InvalidRange(f"empty term in range {text!r}")
        if ".." in term:
            windows += 1
            left, _, right = term.partition("..")
            since = parse_time(left) if left.strip() else None
            until = parse_time(right) if right.strip() else None
            continue
        match = _BATCHES.fullmatch(term)
        if match is None:
            raise InvalidRange(
                f"range term {term!r}: expected TIME..TIME or SHARD:FIRST-LAST (e.g. 0:1-100, *:50-)"
            )
        shard = None if match["shard"] == "*" else int(match["shard"])
        first = int(match["first"]) if match["first"] else None
        last = int(match["last"]) if match["last"] else None
        if first is not None and first < 1:
            raise InvalidRange(f"range term {term!r}: batches are numbered from 1")
        if first is not None and last is not None and first > last:
            raise InvalidRange(f"range term {term!r}: first batch is after the last")
        batches.append(BatchTerm(shard, first, last))
    if windows > 1:
        raise InvalidRange(f"range {text!r} has more than one time window")
    return RangeSpec(since, until, tuple(batches))


@dataclass(frozen=True)
class ShardRange:
    """The batches of one shard that a job reads: disjoint, sorted, inclusive intervals."""

    shard: int
    head: int
    intervals: tuple[tuple[int, int], ...]

    @property
    def batches(self) -> int:
        return sum(last - first + 1 for first, last in self.intervals)

    @property
    def buckets(self) -> tuple[int, ...]:
        found: set[int] = set()
        for first, last in self.intervals:
            found.update(range(bucket_of(first), bucket_of(last) + 1))
        return tuple(sorted(found))


@dataclass(frozen=True)
class ResolvedRange:
    queue: QueueRef
    spec: RangeSpec
    shards: tuple[ShardRange, ...]
    resolved_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def readable(self) -> tuple[ShardRange, ...]:
        """Shards with at least one batch to read."""
        return tuple(s for s in self.shards if s.intervals)

    @property
    def batches(self) -> int:
        return sum(s.batches for s in self.shards)

    @property
    def partitions(self) -> int:
        return sum(len(s.buckets) for s in self.shards)

    def describe(self) -> dict[str, object]:
        return {
            "queue": str(self.queue),
            "range": str(self.spec),
            "since": format_time(self.spec.since) if self.spec.since else None,
            "until": format_time(self.spec.until) if self.spec.until else None,
            "resolved_at": format_time(self.resolved_at),
            "shards": {
                str(s.shard): {"head": s.head, "batches": [list(i) for i in s.intervals]} for s in self.shards
            },
        }


def merge_intervals(intervals: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(i for i in intervals if i[0] <= i[1]):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def clip(intervals: Iterable[tuple[int, int]], low: int, high: int) -> tuple[tuple[int, int], ...]:
    return merge_intervals((max(first, low), min(last, high)) for first, last in intervals)


def shard_terms(spec: RangeSpec, shard: int, head: int) -> list[tuple[int, int]]:
    """The batch intervals the batch terms select in one shard, before time bounds."""
    if not spec.batches:
        return [(1, head)]
    return [
        (term.first or 1, min(term.last if term.last is not None else head, head))
        for term in spec.batches
        if term.shard is None or term.shard == shard
    ]


def _describe_logs(logs: list[int]) -> str:
    if logs == list(range(len(logs))):
        return f"0 to {len(logs) - 1}"
    return ", ".join(map(str, logs))


def resolve(store: Store, queue: QueueRef, spec: RangeSpec) -> ResolvedRange:
    """The per-shard batch intervals of `spec` in `queue` now (heads read once, at the start).

    Batches published after this call are not part of the range, so a job sees a fixed
    snapshot of the log even while publishers go on.
    """
    state = catalog.read_queue(store, queue)
    logs = state.spec.log_shards()
    for term in spec.batches:
        if term.shard is not None and term.shard not in logs:
            raise InvalidRange(f"queue {queue} has no shard {term.shard} (its shards: {_describe_logs(logs)})")
    shards = []
    in_order = state.expiry_in_order(datetime.now(timezone.utc))
    for shard in logs:
        head = catalog.read_int(store, store.paths(queue).head(shard))
        wanted = merge_intervals(shard_terms(spec, shard, head))
        low, high = 1, head
        if wanted:
            # Expired batches would only add empty partitions to read; skip past them.
            if spec.since is not None:
                low = positions.batch_at_time(store, queue, shard, head, spec.since, in_order)
            else:
                low = positions.earliest_batch(store, queue, shard, head, in_order)
            if spec.until is not None:
                high = positions.batch_at_time(store, queue, shard, head, spec.until, in_order) - 1
        shards.append(ShardRange(shard, head, clip(wanted, low, high)))
    return ResolvedRange(queue, spec, tuple(shards))
