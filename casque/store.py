"""The connections every casque component works through: a Cassandra session and a ZooKeeper client.

A `Store` also knows where this installation lives (keyspace, znode root). Components
receive a Store instead of building their own clients, so a test or a process opens the
backends once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cassandra.cluster import Cluster, Session
from kazoo.client import KazooClient

from casque.backends import cql, zk
from casque.config import Settings
from casque.schema import QueueRef
from casque.znodes import QueuePaths, queue_paths


@dataclass
class Store:
    session: Session
    zk: KazooClient
    keyspace: str
    zk_root: str
    replication_cql: str
    cluster: Cluster | None = None
    # Read once (`spans_datacenters`): a datacenter added to the keyspace takes a restart.
    _datacenters: int | None = field(default=None, init=False, repr=False)

    @classmethod
    def open(cls, settings: Settings, namespace: str | None = None) -> Store:
        """Connect to both backends. `namespace`: this process serves that namespace only
        (a sidecar), with its namespace's ZooKeeper identity when the settings carry one."""
        cluster, session = cql.connect(settings)
        try:
            client = zk.connect(settings, namespace=namespace)
        except Exception:
            cluster.shutdown()
            raise
        return cls(
            session=session,
            zk=client,
            keyspace=settings.keyspace,
            zk_root=settings.zookeeper_root,
            replication_cql=settings.replication.cql_map(),
            cluster=cluster,
        )

    def spans_datacenters(self) -> bool:
        """Whether the installation's keyspace has replicas in more than one datacenter."""
        if self._datacenters is None:
            self._datacenters = cql.keyspace_datacenters(self.session, self.keyspace)
        return self._datacenters > 1

    def paths(self, queue: QueueRef) -> QueuePaths:
        return queue_paths(self.zk_root, queue)

    def table(self, queue: QueueRef) -> str:
        return f"{self.keyspace}.{queue.messages_table}"

    def close(self) -> None:
        self.zk.stop()
        self.zk.close()
        if self.cluster is not None:
            self.cluster.shutdown()
