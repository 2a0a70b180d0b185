"""What a keyspace holds on disk across the ring, from Cassandra's own figures.

`system_views.disk_usage` is a virtual table: each node answers for its own SSTables only,
in mebibytes per table, rounded up (a table with any SSTable counts one at least). So every
node is asked, one statement each, and the sum is what the keyspace costs the ring,
replicas included. Memtables not yet flushed are not counted (Cassandra bounds them by its
memtable space, whoever writes), and a node that does not answer is left out and named.
"""

from __future__ import annotations

from dataclasses import dataclass

from cassandra.cluster import Session
from cassandra.query import SimpleStatement

from casque.backends.node_views import on_every_node

MEBIBYTE = 1024 * 1024

_BY_KEYSPACE = SimpleStatement("SELECT mebibytes FROM system_views.disk_usage WHERE keyspace_name = %s")


@dataclass(frozen=True)
class StoredBytes:
    """A keyspace's bytes on disk, summed over the nodes that answered."""

    bytes: int
    nodes_counted: int
    nodes_missing: tuple[str, ...] = ()

    def describe(self) -> str:
        missing = f" (not counted: {', '.join(self.nodes_missing)}, which did not answer)" if self.nodes_missing else ""
        return f"{self.bytes / MEBIBYTE:.0f} MiB on {self.nodes_counted} node(s){missing}"


def keyspace_bytes(session: Session, keyspace: str) -> StoredBytes:
    """The keyspace's SSTables' bytes on every node that is up (blocking): one read per node.
    BackendUnavailable when no node answers."""
    nodes = on_every_node(session, _BY_KEYSPACE, (keyspace,), f"the disk usage of keyspace {keyspace}")
    total = sum(row.mebibytes or 0 for rows in nodes.by_node.values() for row in rows) * MEBIBYTE
    return StoredBytes(total, len(nodes.by_node), nodes.nodes_missing)
