"""How many writes Cassandra has coordinated into a keyspace's tables, from its own figures.

`system_views.coordinator_write_latency` is a virtual table: each node counts, per table,
the writes it coordinated since it started. Every node is asked, one statement each, and the
counts are kept per node, since a node that restarts counts from zero again
(casque.operator.write_quota turns successive counts into a rate). A node that does not
answer is left out and named.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cassandra import DriverException
from cassandra.cluster import Session
from cassandra.query import SimpleStatement

from casque.errors import BackendUnavailable

_BY_KEYSPACE = SimpleStatement(
    "SELECT table_name, count FROM system_views.coordinator_write_latency WHERE keyspace_name = %s")


@dataclass(frozen=True)
class CoordinatedWrites:
    """Writes coordinated into the counted tables since each node started, by node."""

    by_node: Mapping[str, int] = field(default_factory=dict)
    nodes_missing: tuple[str, ...] = ()


def keyspace_writes(session: Session, keyspace: str, counted: Callable[[str], bool]) -> CoordinatedWrites:
    """The writes into the keyspace's tables that `counted` names, per node that is up
    (blocking). BackendUnavailable when no node answers."""
    by_node: dict[str, int] = {}
    missing: list[str] = []
    for host in session.cluster.metadata.all_hosts():
        if host.is_up is False:
            missing.append(str(host.endpoint))
            continue
        try:
            rows = session.execute(_BY_KEYSPACE, (keyspace,), host=host)
        except DriverException:
            missing.append(str(host.endpoint))
            continue
        by_node[str(host.host_id or host.endpoint)] = sum(row.count or 0 for row in rows if counted(row.table_name))
    if not by_node:
        raise BackendUnavailable(f"no Cassandra node answered for the writes into keyspace {keyspace}")
    return CoordinatedWrites(by_node, tuple(missing))
