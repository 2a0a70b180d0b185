"""A consumer process for fault tests: receives and acks, and kills itself with SIGKILL the
moment its ACK_CALLS-th ack call has been answered.

Usage: python -m tests.integration.ack_then_die KEYSPACE CQL_HOST:PORT ZK_HOSTS ACK_CALLS MAX [offsets]
With `offsets`, acks of complete batches wait for the offset write even while the lease is
proven locally (where they would go to rows), so that both ways are killed mid-flight.
Prints one JSON line per delivery and per ack result, with the times (the monotonic clock,
which the test process shares) the call was sent and answered, flushed before the kill:
everything after an answered ack is then what a crash at that instant leaves behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

from kazoo.client import KazooClient

from casque.backends import cql
from casque.config import Settings
from casque.engine.consumer import Consumer, ShardReader
from casque.schema import QueueRef
from casque.store import Store

QUEUE = QueueRef("default", "ackdie")
SUBSCRIBER = "workers"


def emit(**line: object) -> None:
    print(json.dumps(line), flush=True)


async def main(keyspace: str, cassandra: str, zk_hosts: str, ack_calls: int, batch: int) -> None:
    host, _, port = cassandra.rpartition(":")
    cluster, session = cql.connect(Settings(cassandra_contact_points=[host], cassandra_port=int(port), consistency="ONE"))
    client = KazooClient(hosts=zk_hosts, timeout=2.0)
    client.start(timeout=15)
    store = Store(session, client, keyspace, "/casque", "", cluster)
    consumer = Consumer(store, QUEUE, SUBSCRIBER)
    await consumer.start()
    emit(kind="member", member=consumer.member_id)
    calls = 0
    while True:
        sent = time.monotonic()
        # Long: a victim before this one holds the leases until its session expires.
        deliveries = await consumer.receive(max_messages=batch, wait=60)
        answered = time.monotonic()
        if not deliveries:
            raise SystemExit("nothing to receive")
        for d in deliveries:
            emit(kind="delivery", id=d.message.message_id, receipt=d.receipt, count=d.delivery_count,
                 sent=sent, answered=answered)
        sent = time.monotonic()
        results = await consumer.ack_many([d.receipt for d in deliveries])
        answered = time.monotonic()
        for d, result in zip(deliveries, results):
            outcome = result if isinstance(result, bool) else result.code
            emit(kind="ack", id=d.message.message_id, receipt=d.receipt,
                 outcome="acked" if outcome is True else "already_acked" if outcome is False else outcome,
                 sent=sent, answered=answered)
        calls += 1
        if calls == ack_calls:
            # No drain, no release, no flush: whatever an answered ack still needed is lost now.
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    keyspace, cassandra, zk_hosts, ack_calls, batch = sys.argv[1:6]
    if sys.argv[6:7] == ["offsets"]:
        ShardReader.proves_rows_locally = lambda self: False  # type: ignore[method-assign]
    asyncio.run(main(keyspace, cassandra, zk_hosts, int(ack_calls), int(batch)))
