"""Reading a Cassandra virtual table on every node: a virtual table answers for the node
asked only, so one statement goes to each node that is up. A node that does not answer is
left out and named."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cassandra import DriverException
from cassandra.cluster import Session
from cassandra.query import SimpleStatement

from casque.errors import BackendUnavailable


@dataclass(frozen=True)
class NodeRows:
    """Each answering node's rows (by host id, else endpoint), and the nodes that did not answer."""

    by_node: dict[str, list[Any]]
    nodes_missing: tuple[str, ...]


def on_every_node(session: Session, statement: SimpleStatement, params: Sequence[Any], what: str) -> NodeRows:
    """The statement's rows from every node that is up (blocking). BackendUnavailable, naming
    `what`, when no node answers."""
    by_node: dict[str, list[Any]] = {}
    missing: list[str] = []
    for host in session.cluster.metadata.all_hosts():
        if host.is_up is False:
            missing.append(str(host.endpoint))
            continue
        try:
            rows = list(session.execute(statement, params, host=host))
        except DriverException:
            missing.append(str(host.endpoint))
            continue
        by_node[str(host.host_id or host.endpoint)] = rows
    if not by_node:
        raise BackendUnavailable(f"no Cassandra node answered for {what}")
    return NodeRows(by_node, tuple(missing))
