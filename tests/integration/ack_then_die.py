"""A consumer process for fault tests: receives and acks, and kills itself with SIGKILL the
moment its ACK_CALLS-th ack call has been answered.

Usage: python -m tests.integration.ack_then_die KEYSPACE CQL_HOST:PORT ZK_HOSTS ACK_CALLS MAX [zk-check|timeouts]
With `zk-check`, the lease check after an ack row asks ZooKeeper even while the lease is
proven locally, so that both ways are killed mid-flight. With `timeouts`, every other ack-row
write times out at the driver (half of those after the row landed, half before it was sent),
and an ack answered with an error is sent again, as the app client does, until it is
answered: a call counts when all its acks are answered `acked` or `already_acked`.
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

from casque.backends import cql, zk
from casque.config import Settings
from casque.engine.consumer import Consumer
from casque.engine.shard_reader import ShardReader
from casque.engine.messages import Delivery
from casque.errors import BackendUnavailable, CasqueError
from casque.schema import QueueRef
from casque.store import Store
from tests.fixtures.ack_faults import time_out_every_other_ack_row

QUEUE = QueueRef("default", "ackdie")
SUBSCRIBER = "workers"


def emit(**line: object) -> None:
    print(json.dumps(line), flush=True)


async def ack_until_answered(consumer: Consumer, deliveries: list[Delivery]) -> None:
    """Ack, and send again each ack answered with an error (not a stale receipt) until it is answered."""
    pending = deliveries
    while pending:
        sent = time.monotonic()
        try:
            results: list[bool | CasqueError] = await consumer.ack_many([d.receipt for d in pending])
        except CasqueError as error:
            results = [error] * len(pending)
        answered = time.monotonic()
        again = []
        for d, result in zip(pending, results):
            outcome = result if isinstance(result, bool) else result.code
            emit(kind="ack", id=d.message.message_id, receipt=d.receipt,
                 outcome="acked" if outcome is True else "already_acked" if outcome is False else outcome,
                 sent=sent, answered=answered)
            if isinstance(result, BackendUnavailable):
                again.append(d)
        pending = again


def connect_store(keyspace: str, cassandra: str, zk_hosts: str) -> Store:
    """A Store on the test's keyspace and chroot, with a short ZooKeeper session: a killed
    process's leases go soon after it."""
    host, _, port = cassandra.rpartition(":")
    cluster, session = cql.connect(Settings(cassandra_contact_points=[host], cassandra_port=int(port), consistency="ONE"))
    client = zk.keep_granted_timeout(KazooClient(hosts=zk_hosts, timeout=2.0))
    client.start(timeout=15)
    store = Store(session, client, keyspace, "/casque", "", cluster)
    return store


async def main(keyspace: str, cassandra: str, zk_hosts: str, ack_calls: int, batch: int) -> None:
    store = connect_store(keyspace, cassandra, zk_hosts)
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
        await ack_until_answered(consumer, deliveries)
        calls += 1
        if calls == ack_calls:
            # No drain, no release, no flush: whatever an answered ack still needed is lost now.
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    keyspace, cassandra, zk_hosts, ack_calls, batch = sys.argv[1:6]
    if sys.argv[6:7] == ["zk-check"]:
        ShardReader.proves_rows_locally = lambda self: False  # type: ignore[method-assign]
    if sys.argv[6:7] == ["timeouts"]:
        time_out_every_other_ack_row()
    asyncio.run(main(keyspace, cassandra, zk_hosts, int(ack_calls), int(batch)))
