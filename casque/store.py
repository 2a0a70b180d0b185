"""The connections every casque component works through: a Cassandra session and a ZooKeeper client.

A `Store` also knows where this installation lives (keyspace, znode root). Components
receive a Store instead of building their own clients, so a test or a process opens the
backends once.

With a keyspace per namespace (`isolation`, casque.tenancy) the Store of the operator or
the CLI finds each queue's tables in its namespace's keyspace (`keyspace_of`, `table`).
A sidecar's Store knows one keyspace, its namespace's, given to it as CASQUE_KEYSPACE;
`for_namespace` gives an installation Store that same view, for code that takes a Store
and one queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cassandra.cluster import Cluster, Session
from kazoo.client import KazooClient

from casque.backends import cql, zk
from casque.config import Settings
from casque.schema import QueueRef
from casque.tenancy import namespace_keyspace
from casque.znodes import QueuePaths, queue_paths


@dataclass
class Store:
    session: Session
    zk: KazooClient
    keyspace: str
    zk_root: str
    replication_cql: str
    cluster: Cluster | None = None
    # True: `keyspace` is the installation's, and each namespace has a keyspace of its own.
    isolation: bool = False
    # Read once (`spans_datacenters`): a datacenter added to the keyspace takes a restart.
    _datacenters: int | None = field(default=None, init=False, repr=False)

    @classmethod
    def open(cls, settings: Settings, namespace: str | None = None) -> Store:
        """Connect to both backends. `namespace`: this process serves that namespace only
        (a sidecar), with its namespace's ZooKeeper identity when the settings carry one,
        and the Cassandra schema of its keyspace only (`cql.connect`'s `schema_of`)."""
        cluster, session = cql.connect(settings, schema_of=None if namespace is None else settings.keyspace)
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
            isolation=settings.cassandra_isolation == "keyspace",
        )

    def spans_datacenters(self) -> bool:
        """Whether the installation's keyspace has replicas in more than one datacenter."""
        if self._datacenters is None:
            self._datacenters = cql.keyspace_datacenters(self.session, self.keyspace)
        return self._datacenters > 1

    def paths(self, queue: QueueRef) -> QueuePaths:
        return queue_paths(self.zk_root, queue)

    def keyspace_of(self, namespace: str) -> str:
        """The keyspace of `namespace`'s queue tables and shared tables."""
        return namespace_keyspace(self.keyspace, namespace) if self.isolation else self.keyspace

    def namespace_view_keyspace(self, what: str) -> str:
        """The keyspace of code that knows a queue by its shared-table key only, not its
        namespace: it must be given a namespace's view (`for_namespace`)."""
        if self.isolation:
            # A programming error: the installation keyspace holds no namespace's rows.
            raise RuntimeError(f"{what} needs a namespace's Store (store.for_namespace) with keyspace isolation")
        return self.keyspace

    def for_namespace(self, namespace: str) -> Store:
        """This Store as a sidecar of `namespace` sees it: one keyspace, the namespace's.

        Same connections (not closed by the view). Engine code that names tables by
        `store.keyspace` works for that namespace's queues through it.
        """
        if not self.isolation:
            return self
        return replace(self, keyspace=self.keyspace_of(namespace), isolation=False, cluster=None)

    def table(self, queue: QueueRef) -> str:
        return f"{self.keyspace_of(queue.namespace)}.{queue.messages_table}"

    def close(self) -> None:
        self.zk.stop()
        self.zk.close()
        if self.cluster is not None:
            self.cluster.shutdown()
