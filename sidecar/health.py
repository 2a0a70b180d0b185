"""The sidecar's health as its probes and its scrapes see it: readiness and the consumers' gauges."""

from __future__ import annotations

import asyncio
import contextlib

from kazoo.client import KazooState
from kazoo.exceptions import NoNodeError

from casque.errors import BackendUnavailable, NewerFormat
from casque.sidecar.errors import BACKEND_FAILURES
from casque.sidecar.service import QueueService

# The stall report reads the backends; a probe must be answered even when one of them holds
# requests without answering (a blackhole), so the report gets this long and is left out after.
STALL_REPORT_SECONDS = 3.0


async def readiness(service: QueueService, serving_only: bool = False) -> tuple[bool, dict[str, str]]:
    """Ready: both backends answer, and every served subscriber holds the shards it is due.

    `serving_only` (the Pod's readiness probe): the sidecar can take the app's calls, so
    not draining and Cassandra up (ZooKeeper too when it serves subscribers). A member
    short of its shards is still reported in full by /readyz, but it does not take
    the Pod out of its Services: that would stop the app's own traffic, which a
    rebalance has nothing to do with.
    """
    checks: dict[str, str] = {}
    ready = not service.draining
    if service.draining:
        checks["sidecar"] = "draining"
    zk_ok = service.store.zk.state == KazooState.CONNECTED
    checks["zookeeper"] = "connected" if zk_ok else f"not connected ({service.store.zk.state})"
    cluster = service.store.session.cluster
    cassandra_ok = any(host.is_up for host in cluster.metadata.all_hosts())
    checks["cassandra"] = "up" if cassandra_ok else "no host up"
    ready = ready and cassandra_ok and (zk_ok or not service.subscriptions)
    if service.protocol.refusal is not None:
        # Nothing is written in a protocol this release cannot speak: upgrade, or roll the installation back.
        checks["protocol"] = str(service.protocol.refusal)
        ready = False
    if serving_only:
        return ready, checks
    ready = ready and zk_ok
    for name, subscription in service.subscriptions.items():
        consumer = subscription.consumer
        if consumer is None:
            checks[f"subscriber/{name}"] = subscription.problem
            ready = False
            continue
        try:
            healthy, detail = await consumer.health()
        except (BackendUnavailable, NoNodeError) as error:
            healthy, detail = False, f"cannot read members: {error}"
        checks[f"subscriber/{name}"] = detail
        checks[f"member/{name}"] = consumer.member_id
        # A record of a later format is named by the shard that meets it (casque.formats).
        with contextlib.suppress(*BACKEND_FAILURES, BackendUnavailable, NoNodeError, TimeoutError, NewerFormat):
            # Reported, not counted (casque.sidecar.stalls says why).
            report = await asyncio.wait_for(service.stalls.report(name, consumer), STALL_REPORT_SECONDS)
            checks[f"stall/{name}"] = report.detail()
        if subscription.push is not None and subscription.push.problem:
            # Reported, not counted: the app can still receive, and a restart would not fix it.
            checks[f"push/{name}"] = subscription.push.problem
        ready = ready and healthy
    return ready, checks


async def refresh_gauges(service: QueueService) -> None:
    """The gauges of this sidecar's consumers, read when /metrics is scraped."""
    metrics = service.metrics
    metrics.count_refusals()
    for name, subscription in service.subscriptions.items():
        consumer = subscription.consumer
        if consumer is None:
            continue
        metrics.in_flight.labels(name).set(consumer.in_flight())
        metrics.leases.labels(name).set(len(consumer.held_shards))
        try:
            metrics.unread_shards.labels(name).set((await consumer.shard_status()).unread)
            stalls = await service.stalls.report(name, consumer)
        except (*BACKEND_FAILURES, BackendUnavailable, NoNodeError, NewerFormat):
            continue
        queue = consumer.queue.name
        metrics.stalled_shards.labels(queue, name).set(len(stalls.stalled))
        metrics.stall_seconds.labels(queue, name).set(stalls.longest_wait_seconds)
        metrics.stall_threshold.labels(queue, name).set(stalls.threshold)
