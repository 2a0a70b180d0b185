"""A namespace's stored bytes against its quota (`quota.casque.io/max-stored-bytes`).

With keyspace isolation a namespace's queues and shared tables are one keyspace, and its
role may write that keyspace directly, past any sidecar: only Cassandra can refuse it. So
the operator measures the keyspace on disk (casque.backends.disk_usage: every node's
SSTables, replicas included) and, while it is over the limit, narrows the role's writes to
the tables its consumers write (casque.schema.CONSUMING_TABLES): every publish, and any
write of the namespace's own to its queues, is refused, and its consumers still ack and
drain. Under the limit again (retention expires what it holds, or its queues are purged),
the role writes everywhere again. The figure moves as Cassandra flushes and compacts:
memtables are not counted, so a namespace may go past its limit by what Cassandra holds in
memory before it is refused.

The same narrowing holds a namespace to its write rate (casque.operator.write_quota): it
may publish while it is within both.

Each namespace is measured at most once per refresh interval, whichever of its Queues'
timers comes first; the writes are changed only when the verdict changes (and once after
the operator starts, since another replica may have left them either way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from casque.backends import disk_usage, write_counts
from casque.backends.disk_usage import MEBIBYTE, StoredBytes
from casque.engine import catalog
from casque.operator.write_quota import RateVerdict, WriteAllowance
from casque.schema import CONSUMING_TABLES
from casque.store import Store
from casque.tenancy import NamespaceRole

PUBLISHING = "Publishing"


@dataclass(frozen=True)
class StorageVerdict:
    """What a namespace stores, its limit (None: none), its write rate against its limit
    (None: no limit), and so whether it may publish."""

    stored: StoredBytes
    limit: int | None
    rate: RateVerdict | None = None

    @property
    def within_stored_bytes(self) -> bool:
        return self.limit is None or self.stored.bytes <= self.limit

    @property
    def publishing(self) -> bool:
        return self.within_stored_bytes and (self.rate is None or self.rate.within)

    @property
    def reason(self) -> str:
        """The Publishing condition's reason."""
        if not self.within_stored_bytes:
            return "StoredBytesQuotaExceeded"
        if self.rate is not None and not self.rate.within:
            return "WriteRateQuotaExceeded"
        return "WithinQuota"

    def describe(self) -> str:
        if self.limit is None:
            stored = f"the namespace stores {self.stored.describe()}; it has no stored-bytes limit"
        else:
            limit = f"its limit of {self.limit / MEBIBYTE:.0f} MiB (quota.casque.io/max-stored-bytes)"
            if self.within_stored_bytes:
                stored = f"the namespace stores {self.stored.describe()}, within {limit}"
            else:
                stored = (f"the namespace stores {self.stored.describe()}, over {limit}: Cassandra refuses its "
                          "publishes until it is under; its consumers still ack")
        return stored if self.rate is None else f"{stored}; {self.rate.describe()}"


@dataclass
class NamespaceStorage:
    """The operator's last verdict per namespace, and the writes it last gave each role."""

    interval_seconds: float
    _verdicts: dict[str, tuple[float, StorageVerdict]] = field(default_factory=dict)
    _applied: dict[str, bool] = field(default_factory=dict)
    _allowances: dict[str, WriteAllowance] = field(default_factory=dict)

    def verdict(self, store: Store, role: NamespaceRole, namespace: str, limit: int | None,
                rate_limit: float | None = None) -> StorageVerdict:
        """The namespace's verdict, measured again once the interval has passed or a limit
        changed (blocking)."""
        now = time.monotonic()
        cached = self._verdicts.get(namespace)
        if (cached is not None and now - cached[0] < self.interval_seconds and cached[1].limit == limit
                and (cached[1].rate.limit if cached[1].rate else None) == rate_limit):
            return cached[1]
        stored = disk_usage.keyspace_bytes(store.session, role.keyspace)
        verdict = StorageVerdict(stored, limit, self._rate(store, role, namespace, rate_limit, now))
        self._verdicts[namespace] = (now, verdict)
        return verdict

    def _rate(self, store: Store, role: NamespaceRole, namespace: str, limit: float | None,
              now: float) -> RateVerdict | None:
        if limit is None:
            self._allowances.pop(namespace, None)
            return None
        allowance = self._allowances.get(namespace)
        if allowance is None or allowance.limit != limit:
            allowance = self._allowances[namespace] = WriteAllowance(limit)
        writes = write_counts.keyspace_writes(store.session, role.keyspace, lambda table: table not in CONSUMING_TABLES)
        return allowance.measure(now, writes.by_node)

    def publishing(self, namespace: str) -> bool:
        """Whether the namespace may publish, as last measured (yes when never measured)."""
        cached = self._verdicts.get(namespace)
        return cached is None or cached[1].publishing

    def enforce(self, store: Store, role: NamespaceRole, namespace: str, verdict: StorageVerdict) -> bool:
        """Give the role the writes the verdict allows, if it was not given them last
        (blocking). Returns whether they changed."""
        if self._applied.get(namespace) == verdict.publishing:
            return False
        catalog.set_namespace_publishing(store, role, verdict.publishing)
        changed = namespace in self._applied
        self._applied[namespace] = verdict.publishing
        return changed

    def granted(self, namespace: str, publishing: bool) -> None:
        """The role was just given these writes another way (made or updated whole)."""
        self._applied[namespace] = publishing

    def forget(self, namespace: str) -> None:
        """The namespace's role is gone (its last Queue deleted)."""
        self._verdicts.pop(namespace, None)
        self._applied.pop(namespace, None)
        self._allowances.pop(namespace, None)
