"""A namespace's write rate against its quota (`quota.casque.io/max-writes-per-second`).

Cassandra 5.0 limits requests per node, not per role, so the rate is measured and enforced
as the stored bytes are (casque.operator.storage_quota): the operator reads how many writes
Cassandra coordinated into the namespace's publishing tables (casque.backends.write_counts;
its consumers' tables are not counted, and stay writable) and, while the namespace has used
more than its allowance, narrows its role's writes so that Cassandra refuses its publishes.

The allowance is a token bucket: it fills at the limit, up to `BURST_SECONDS` of it, and
each measure takes out the writes made since the one before. A namespace that wrote ten
times its rate for one interval is refused for about nine intervals after it, so over time
it writes no faster than its limit. The bound holds at the measures' grain: between two
measures (the refresh interval) a namespace may write at any rate, and pays for it after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# How much unused rate a namespace may save up: a burst of this many seconds at its limit.
BURST_SECONDS = 60.0


def writes_between(before: Mapping[str, int], now: Mapping[str, int]) -> int:
    """Writes made between two readings of the nodes' counts. A node whose count went down
    restarted, and counts from zero; a node not read before is taken as a new baseline (its
    writes until now are not known to fall in this interval)."""
    total = 0
    for node, count in now.items():
        previous = before.get(node)
        if previous is None:
            continue
        total += count - previous if count >= previous else count
    return total


@dataclass(frozen=True)
class RateVerdict:
    """A namespace's write rate over the last interval, its limit, and whether it may publish."""

    writes_per_second: float | None  # None: the first measure, with nothing to compare
    limit: float
    allowance: float  # writes it may still make; below 0 it is refused until refilled

    @property
    def within(self) -> bool:
        return self.allowance >= 0

    def describe(self) -> str:
        rate = "not yet measured" if self.writes_per_second is None else f"{self.writes_per_second:.1f} writes/s"
        limit = f"its limit of {self.limit:g} writes/s (quota.casque.io/max-writes-per-second)"
        if self.within:
            return f"the namespace wrote {rate}, within {limit}"
        wait = -self.allowance / self.limit
        return (f"the namespace wrote {rate}, over {limit}: Cassandra refuses its publishes for about "
                f"{wait:.0f} s more at that limit; its consumers still ack")


@dataclass
class WriteAllowance:
    """The token bucket of one namespace, fed with successive readings of its write counts."""

    limit: float
    _allowance: float | None = None
    _last_at: float | None = None
    _last_counts: dict[str, int] = field(default_factory=dict)

    def measure(self, now: float, counts: Mapping[str, int]) -> RateVerdict:
        """The verdict after a reading taken at `now` (seconds, monotonic)."""
        capacity = self.limit * BURST_SECONDS
        rate = None
        if self._last_at is None or self._allowance is None:
            allowance = capacity
        else:
            elapsed = max(now - self._last_at, 0.0)
            written = writes_between(self._last_counts, counts)
            rate = written / elapsed if elapsed > 0 else None
            allowance = min(self._allowance + self.limit * elapsed, capacity) - written
        self._allowance, self._last_at, self._last_counts = allowance, now, dict(counts)
        return RateVerdict(rate, self.limit, allowance)
