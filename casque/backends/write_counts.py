"""How many writes Cassandra has coordinated into a keyspace's tables, from its own figures.

`system_views.coordinator_write_latency` is a virtual table: each node counts, per table,
the writes it coordinated since it started. Every node is asked (casque.backends.node_views),
and the counts are kept per node, since a node that restarts counts from zero again
(casque.operator.write_quota turns successive counts into a rate).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cassandra.cluster import Session
from cassandra.query import SimpleStatement

from casque.backends.node_views import on_every_node

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
    nodes = on_every_node(session, _BY_KEYSPACE, (keyspace,), f"the writes into keyspace {keyspace}")
    by_node = {node: sum(row.count or 0 for row in rows if counted(row.table_name))
               for node, rows in nodes.by_node.items()}
    return CoordinatedWrites(by_node, nodes.nodes_missing)
