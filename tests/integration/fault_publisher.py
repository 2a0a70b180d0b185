"""A publisher process for fault tests: publishes N messages and prints one JSON line per ack.

Usage: python -m tests.integration.fault_publisher NAME COUNT KEYSPACE CQL_HOST:PORT ZK_HOSTS
It registers an ephemeral znode /alive/NAME so the test can see when its session expires.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from kazoo.client import KazooClient

from casque.backends import cql
from casque.config import Settings
from casque.engine import catalog
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import BackendUnavailable
from casque.schema import QueueRef
from casque.store import Store

QUEUE = QueueRef("default", "faults")


async def main(name: str, count: int, keyspace: str, cassandra: str, zk_hosts: str) -> None:
    host, _, port = cassandra.rpartition(":")
    cluster, session = cql.connect(Settings(cassandra_contact_points=[host], cassandra_port=int(port), consistency="ONE"))
    client = KazooClient(hosts=zk_hosts, timeout=2.0)
    client.start(timeout=15)
    client.create(f"/alive/{name}", b"", ephemeral=True, makepath=True)
    store = Store(session, client, keyspace, "/casque", "", cluster)
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE), publisher_id=name)
    for i in range(count):
        # Like an app would: retry a failed publish for a while (a retried message may be
        # stored twice; only acknowledged ones are printed).
        deadline = time.monotonic() + 120
        while True:
            try:
                (result,) = await publisher.publish([OutgoingMessage(f"{name}-{i}".encode())])
                break
            except BackendUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        line = {"payload": f"{name}-{i}", "id": result.message_id, "shard": result.shard,
                "batch": result.batch, "seq": result.seq}
        print(json.dumps(line), flush=True)
    await publisher.flush_heads()
    store.close()


if __name__ == "__main__":
    name, count, keyspace, cassandra, zk_hosts = sys.argv[1:6]
    asyncio.run(main(name, int(count), keyspace, cassandra, zk_hosts))
