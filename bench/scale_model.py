"""Scale model: what a cluster of N Cassandra nodes carries, from costs measured on the local stack.

    python bench/scale_model.py [--messages 20000] [--size 1024] [--shards 4] [--runs 1]
        [--json] [--smoke] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]
        [--ring] [--write-docs docs/scaling.md] [--from-json results.json]

Measures, on the Cassandra and ZooKeeper at --cassandra/--zookeeper (local processes: their
CPU time is read from /proc), in a keyspace of its own:
- Cassandra CPU seconds per 1,000 messages published, split into a cost per batch (the
  conditional claim) and a cost per message from two runs at different batch sizes, and
  per 1,000 messages received and acked;
- the client's (this process's) and ZooKeeper's CPU per 1,000 messages;
- ZooKeeper writes per 1,000 messages (the zxid delta: every write transaction), publishing
  and consuming, and the claim round trip;
- bytes per message on disk (after `nodetool flush`) and so a bucket partition's size.

From them it models 1 to 100 nodes and 1k to 1M msgs/s (see docs/scaling.md for the
assumptions), then checks the model against a run at another batch size on the same stack
and, with --ring, against a three-node ring (RF 3) it starts on ports of its own, all nodes
sharing this host's cores. --write-docs rewrites docs/scaling.md from the results.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import time
import uuid
from contextlib import redirect_stdout
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from casque.config import ReplicationSettings, Settings
from casque.devstack.cassandra import CassandraNode
from casque.devstack.stack import Stack, StackPorts
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.engine.shard_writer import MAX_BATCH_MESSAGES
from casque.schema import BATCHES_PER_BUCKET, MAX_BATCH_BYTES, TWCS_TARGET_WINDOWS, QueueRef
from casque.specs import MAX_SHARDS, QueueSpec, SubscriberSpec
from casque.store import Store

from benchlib import CLOCK_TICKS, Figure, arguments, cpu_seconds, drop_scratch, parse, pipeline, report

ROOT = Path(__file__).resolve().parents[1]
# The three-node ring of the check: ports no test slot, dev stack or other benchmark uses.
RING_PORTS = StackPorts(native=55042, storage=55000, jmx=55199, zookeeper=55181,
                        zookeeper_quorum=55881, zookeeper_election=55981)

# Assumptions of the model (stated in docs/scaling.md with the results).
NODE_CORES = 8            # cores per production Cassandra node
CPU_HEADROOM = 0.6        # share of a node's CPU the queue may use (compaction, repair, GC, peaks)
REPLICATION = 3           # replicas per datacenter once there are 3 nodes or more
SUBSCRIBERS = 1           # each message read (and acked) once per subscriber
ZK_WRITE_CEILING = 10_000  # writes/s a 3-member ZooKeeper ensemble on SSDs sustains (assumed)
DISK_PER_NODE = 1e12      # usable bytes per node for queue data (half a 2 TB disk)
RETENTION_S = 86_400      # retention of the storage figures: one day
# TWCS drops an SSTable once all of it expired: a window's worth more than the retention stays.
TWCS_OVERHANG = 1 + 1 / TWCS_TARGET_WINDOWS
PARTITION_GUIDELINE = 100e6  # bytes: Cassandra's usual ceiling for one partition
NODE_COUNTS = (1, 3, 10, 30, 100)
ASSUMPTIONS = {"node_cores": NODE_CORES, "cpu_headroom": CPU_HEADROOM, "replication": REPLICATION,
               "subscribers": SUBSCRIBERS, "zk_write_ceiling": ZK_WRITE_CEILING, "disk_per_node": DISK_PER_NODE,
               "retention_s": RETENTION_S, "twcs_windows": TWCS_TARGET_WINDOWS}
RATES = (1_000, 10_000, 100_000, 1_000_000)

FIGURES = [
    Figure("claim_cpu_ms", "Cassandra CPU per batch claim (RF 1)", "ms"),
    Figure("write_cpu_per_1000", "Cassandra CPU per 1,000 msgs written, per message", "ms"),
    Figure("publish_cpu_per_1000", "  publish at the large batch size, all in", "ms"),
    Figure("publish_batch", "  that batch size", "msgs"),
    Figure("read_cpu_per_1000", "Cassandra CPU per 1,000 msgs received+acked", "ms"),
    Figure("client_cpu_per_1000", "client CPU per 1,000 msgs published+consumed", "ms"),
    Figure("zookeeper_cpu_per_1000", "ZooKeeper CPU per 1,000 msgs published+consumed", "ms"),
    Figure("zk_writes_publish_per_1000", "ZooKeeper writes per 1,000 msgs published", ""),
    Figure("zk_writes_consume_per_1000", "ZooKeeper writes per 1,000 msgs consumed", ""),
    Figure("zk_writes_per_shard_s", "ZooKeeper writes per shard-second at full load", ""),
    Figure("claim_ms", "claim round trip (batch write)", "ms"),
    Figure("disk_bytes_per_msg", "bytes per message on disk (one replica)", "B"),
    Figure("bucket_partition_mb", "bucket partition at the large batch size", "MB"),
    Figure("large_publish_rate", "publish rate of the large-batch run", "msgs/s"),
    Figure("consume_rate", "receive+ack rate", "msgs/s"),
    Figure("check_1_free_cores", "check, 1 node: cores free of other load", "x"),
    Figure("check_1_predicted", "check, 1 node: predicted publish", "msgs/s"),
    Figure("check_1_measured", "  measured", "msgs/s"),
    Figure("check_1_ratio", "  measured / predicted", "x"),
    Figure("check_batch", "  its average batch", "msgs"),
    Figure("check_1_claim_ms", "  its claim round trip", "ms"),
    Figure("check_1_busy", "  cores busy (of the host's)", "x"),
    Figure("ring_claim_cpu_ms", "3-node ring, RF 3: Cassandra CPU per claim, all nodes", "ms"),
    Figure("ring_write_cpu_per_1000", "  per 1,000 msgs written, per message", "ms"),
    Figure("ring_read_cpu_per_1000", "  per 1,000 msgs received+acked", "ms"),
    Figure("ring_write_vs_naive", "  writing, against 3x the one-node cost", "x"),
    Figure("check_3_free_cores", "check, 3 nodes: cores free of other load", "x"),
    Figure("check_3_predicted", "check, 3 nodes on the same cores: predicted publish", "msgs/s"),
    Figure("check_3_measured", "  measured", "msgs/s"),
    Figure("check_3_ratio", "  measured / predicted", "x"),
    Figure("check_3_batch", "  its average batch", "msgs"),
    Figure("check_3_claim_ms", "  its claim round trip", "ms"),
    Figure("check_3_busy", "  cores busy (of the host's)", "x"),
    Figure("check_3_naive_predicted", "  predicted from 3x the one-node cost instead", "msgs/s"),
]


# --- the local processes ------------------------------------------------------------------

def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _flag(cmdline: list[str], prefix: str) -> str | None:
    return next((arg[len(prefix):] for arg in cmdline if arg.startswith(prefix)), None)


def cassandra_nodes(port: int) -> list[tuple[int, CassandraNode]]:
    """The local Cassandra JVMs whose CQL port is `port` (every node of a local ring), with
    what nodetool and the data directory need."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        cmdline = _cmdline(int(entry.name))
        if "org.apache.cassandra.service.CassandraDaemon" not in cmdline:
            continue
        config = _flag(cmdline, "-Dcassandra.config=file://")
        storage = _flag(cmdline, "-Dcassandra.storagedir=")
        jmx = _flag(cmdline, "-Dcassandra.jmx.local.port=")
        if not (config and storage and jmx):
            continue
        try:
            yaml = Path(config).read_text()
        except OSError:
            continue
        native = re.search(r"^native_transport_port:\s*(\d+)", yaml, re.MULTILINE)
        address = re.search(r"^rpc_address:\s*(\S+)", yaml, re.MULTILINE)
        if native and int(native.group(1)) == port and address:
            found.append((int(entry.name), CassandraNode(Path(storage), address=address.group(1),
                                                         native_port=port, jmx_port=int(jmx))))
    return sorted(found, key=lambda item: item[1].address)


def zookeeper_pids(port: int) -> list[int]:
    """The local ZooKeeper servers that serve clients on `port`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        cmdline = _cmdline(int(entry.name))
        configs = [arg for arg in cmdline if arg.endswith("zoo.cfg")]
        if not configs or not any("zookeeper" in arg.lower() for arg in cmdline):
            continue
        try:
            text = Path(configs[-1]).read_text()
        except OSError:
            continue
        if re.search(rf"^clientPort={port}$", text, re.MULTILINE):
            pids.append(int(entry.name))
    return pids


def zxid(zookeeper: str) -> int:
    """The server's last zxid: it grows by one for every write transaction."""
    host, _, port = zookeeper.split(",")[0].split("/")[0].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"srvr")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    found = re.search(rb"Zxid: (0x[0-9a-f]+)", answer)
    if found is None:
        raise SystemExit(f"ZooKeeper at {zookeeper} gave no zxid to `srvr`: {answer[:200]!r}")
    return int(found.group(1), 16) & 0xFFFFFFFF  # the counter; the high half is the epoch


@dataclass
class Meter:
    """CPU of Cassandra, ZooKeeper and this process, and ZooKeeper writes, over a phase."""

    cassandra: list[int]
    zookeeper: list[int]
    zk_hosts: str

    def read(self) -> tuple[float, ...]:
        return (cpu_seconds(self.cassandra), cpu_seconds(self.zookeeper), time.process_time(),
                zxid(self.zk_hosts), time.perf_counter(), host_busy_seconds())

    def since(self, before: tuple[float, ...]) -> dict[str, float]:
        now = self.read()
        usage = {"cassandra": now[0] - before[0], "zookeeper": now[1] - before[1], "client": now[2] - before[2],
                 "zk_writes": now[3] - before[3], "seconds": now[4] - before[4]}
        # CPU the host spent on anything else meanwhile (other processes, and time the
        # hypervisor gave to other guests): cores the stack could not have.
        usage["others"] = max(0.0, now[5] - before[5] - usage["cassandra"] - usage["zookeeper"] - usage["client"])
        return usage


def host_busy_seconds() -> float:
    """CPU seconds the host's cores were busy or stolen, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


# --- the measurements ---------------------------------------------------------------------

@dataclass
class Phase:
    messages: int
    batches: int
    usage: dict[str, float]
    shards: int = 1  # shards that took batches

    @property
    def batch(self) -> float:
        return self.messages / max(1, self.batches)

    @property
    def rate(self) -> float:
        return self.messages / self.usage["seconds"]

    def per_message(self, what: str) -> float:
        return self.usage[what] / self.messages


async def publish_phase(store: Store, queue: QueueRef, meter: Meter, messages: int, call: int, window: int,
                        payload: bytes) -> tuple[Phase, Publisher]:
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    calls = max(1, messages // call)
    # Each message its own random bytes: copies of one payload would compress to nothing on disk.
    batches = [[OutgoingMessage(os.urandom(len(payload))) for _ in range(call)] for _ in range(calls)]
    before = meter.read()
    await pipeline(calls, window, lambda i: publisher.publish(batches[i]))
    await publisher.flush_heads()
    usage = meter.since(before)
    # Unkeyed messages go to the publisher's preferred shard and spill over only under a
    # backlog, so not every shard need have taken batches (queues here start empty).
    heads = [int(store.zk.get(store.paths(queue).head(shard))[0] or b"0") for shard in range(queue_shards(store, queue))]
    return Phase(calls * call, publisher.counters.batches, usage, max(1, sum(1 for h in heads if h))), publisher


def queue_shards(store: Store, queue: QueueRef) -> int:
    return catalog.read_queue(store, queue).spec.shards


async def consume_phase(store: Store, queue: QueueRef, meter: Meter, messages: int) -> Phase:
    consumer = Consumer(store, queue, "model")
    await consumer.start()
    received = 0
    before = meter.read()
    try:
        while received < messages:
            deliveries = await consumer.receive(max_messages=256, wait=5)
            if not deliveries:
                raise SystemExit(f"consumer stalled after {received} of {messages}")
            await consumer.ack_many([d.receipt for d in deliveries])
            received += len(deliveries)
    finally:
        await consumer.stop()
    return Phase(received, consumer.counters.batch_reads, meter.since(before))


def disk_bytes(nodes: list[CassandraNode], keyspace: str, table: str) -> int:
    """Bytes of the table's SSTables (every component) on all nodes, after a flush."""
    total = 0
    for node in nodes:
        node.nodetool("flush", keyspace, table)
        for directory in (node.directory / "data" / keyspace).glob(f"{table}-*"):
            total += sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    return total


def open_store(cassandra: str, zookeeper: str, consistency: str, replicas: int) -> tuple[Store, Settings]:
    host, _, port = cassandra.rpartition(":")
    keyspace = f"scale_{uuid.uuid4().hex[:8]}"
    settings = Settings(cassandra_contact_points=[host], cassandra_port=int(port), consistency=consistency,
                        keyspace=keyspace, zookeeper_hosts=zookeeper, zookeeper_root=f"/bench-{keyspace}",
                        replication=ReplicationSettings(factor=replicas))
    store = Store.open(settings)
    catalog.ensure_installation(store)
    return store, settings


async def measure(args: argparse.Namespace) -> dict[str, float]:
    """The model's inputs on the stack at --cassandra/--zookeeper, and the 1-node check."""
    port = int(args.cassandra.rpartition(":")[2])
    found = cassandra_nodes(port)
    if not found:
        raise SystemExit(f"no local Cassandra serves CQL on port {port}: the model reads its CPU time from /proc")
    meter = Meter([pid for pid, _ in found], zookeeper_pids(int(args.zookeeper.split(",")[0].split("/")[0]
                                                                  .rpartition(":")[2])), args.zookeeper)
    store, settings = open_store(args.cassandra, args.zookeeper, "ONE", 1)
    payload = os.urandom(args.size)
    spec = QueueSpec(shards=args.shards, retention_seconds=3600, consistency="ONE")
    try:
        warmup_q, large_q, small_q, check_q = (QueueRef("default", name)
                                               for name in ("warmup", "large", "small", "check"))
        for queue in (warmup_q, large_q, small_q, check_q):
            catalog.apply_queue(store, queue, spec)
        catalog.apply_subscriber(store, large_q, "model", SubscriberSpec(queue=large_q.name, start_position="earliest"))
        if not args.smoke:  # the JIT compiles the write path first, which the costs should not include
            await publish_phase(store, warmup_q, meter, args.messages // 2, 100, 32, payload)
        # Large batches (100-message calls, many in flight) and small ones (single messages, a
        # few in flight): two batch sizes separate the cost of a claim from that of a message.
        large, _ = await publish_phase(store, large_q, meter, args.messages, 100, 32, payload)
        small, _ = await publish_phase(store, small_q, meter, max(200, args.messages // 10), 1, 2 * args.shards,
                                       payload)
        consume = await consume_phase(store, large_q, meter, large.messages)
        per_claim, per_message = split_costs(large, small, "cassandra")
        table = store.table(large_q).split(".")[1]
        on_disk = disk_bytes([node for _, node in found], settings.keyspace, table) / large.messages
        # The check: another batch size (10-message calls), predicted from the costs above.
        check, _ = await publish_phase(store, check_q, meter, args.messages // 2, 10, 64, payload)
    finally:
        drop_scratch(store, settings)
        store.close()
    client_claim, client_message = split_costs(large, small, "client")
    zk_cpu = (large.usage["zookeeper"] + consume.usage["zookeeper"]) / large.messages
    costs = {
        "claim_cpu_ms": per_claim * 1000,
        "write_cpu_per_1000": per_message * 1e6,
        "publish_cpu_per_1000": large.per_message("cassandra") * 1e6,
        "publish_batch": large.batch,
        "read_cpu_per_1000": consume.per_message("cassandra") * 1e6,
        "client_claim_ms": client_claim * 1000,
        "client_write_per_1000": client_message * 1e6,
        "client_read_per_1000": consume.per_message("client") * 1e6,
        "client_cpu_per_1000": (large.per_message("client") + consume.per_message("client")) * 1e6,
        "zookeeper_cpu_per_1000": zk_cpu * 1e6,
        "zk_publish_cpu_per_1000": large.per_message("zookeeper") * 1e6,
        "zk_writes_publish_per_1000": large.per_message("zk_writes") * 1000,
        "zk_writes_consume_per_1000": consume.per_message("zk_writes") * 1000,
        "zk_writes_per_shard_s": (large.usage["zk_writes"] / large.usage["seconds"]
                                  + consume.usage["zk_writes"] / consume.usage["seconds"]) / large.shards,
        # One claim in flight per shard: a shard's batches follow each other back to back.
        "claim_ms": 1000 * large.shards * large.usage["seconds"] / max(1, large.batches),
        "active_shards": large.shards,
        "disk_bytes_per_msg": on_disk,
        "bucket_partition_mb": BATCHES_PER_BUCKET * large.batch * on_disk / 1e6,
        "size": args.size,
    }
    costs["large_publish_rate"] = large.rate
    costs["consume_rate"] = consume.rate
    costs["check_1_predicted"] = host_prediction(costs, check.batch, per_claim, per_message, free_cores(check))
    costs["check_1_claim_ms"] = 1000 * check.shards * check.usage["seconds"] / max(1, check.batches)
    costs["check_1_busy"] = busy(check)
    costs["check_1_measured"] = check.rate
    costs["check_1_free_cores"] = free_cores(check)
    costs["check_1_ratio"] = check.rate / costs["check_1_predicted"]
    costs["check_batch"] = check.batch
    return costs


def split_costs(large: Phase, small: Phase, what: str) -> tuple[float, float]:
    """(seconds per batch, seconds per message) of `what`'s CPU from two batch sizes:
    cost/message = per_batch / batch + per_message."""
    a, b = large.per_message(what), small.per_message(what)
    if abs(1 / small.batch - 1 / large.batch) < 1e-9:
        return 0.0, a
    per_batch = max(0.0, (b - a) / (1 / small.batch - 1 / large.batch))
    return per_batch, max(0.0, a - per_batch / large.batch)


def free_cores(phase: Phase) -> float:
    """The host's cores less what other processes took during `phase`."""
    cores = float(os.cpu_count() or 1)
    return max(0.1, cores - phase.usage["others"] / phase.usage["seconds"])


def write_costs(costs: dict[str, float], replicas: int) -> tuple[float, float]:
    """Cassandra CPU seconds (all replicas) per claim and per message written at `replicas`
    replicas: as measured on the three-node ring when it ran, else the one-node costs times
    the replicas (which the ring shows to be far too low: see docs/scaling.md)."""
    if replicas >= REPLICATION and "ring_claim_cpu_ms" in costs:
        return costs["ring_claim_cpu_ms"] / 1000, costs["ring_write_cpu_per_1000"] / 1e6
    return replicas * costs["claim_cpu_ms"] / 1000, replicas * costs["write_cpu_per_1000"] / 1e6


def read_cost(costs: dict[str, float], replicas: int) -> float:
    """Cassandra CPU seconds (all replicas) per message received and acked."""
    if replicas >= REPLICATION and "ring_read_cpu_per_1000" in costs:
        return costs["ring_read_cpu_per_1000"] / 1e6
    return (replicas // 2 + 1) * costs["read_cpu_per_1000"] / 1e6


def host_prediction(costs: dict[str, float], batch: float, claim: float, message: float, cores: float) -> float:
    """Publish msgs/s of this host, where every process shares its cores: the CPU of all of
    them per message (Cassandra's `claim` per batch and `message` per message, on all its
    nodes); and no more than the one core the (single-threaded) client can use allows."""
    cassandra = claim / batch + message
    client = costs["client_claim_ms"] / 1000 / batch + costs["client_write_per_1000"] / 1e6
    zookeeper = costs["zk_publish_cpu_per_1000"] / 1e6
    return min(cores / (cassandra + client + zookeeper), 1 / client)


async def ring_check(args: argparse.Namespace, costs: dict[str, float]) -> None:
    """Start a three-node ring on RING_PORTS and measure what replication costs there (RF 3,
    LOCAL_QUORUM: claims and rows at two batch sizes, receive+ack), then check the model at a
    third batch size against a prediction for three nodes on this host's cores."""
    root = Path(tempfile.mkdtemp(prefix="casque-scale-ring-"))
    stack = Stack(root=root, nodes=3, ports=RING_PORTS, heap_mb=768, cluster_name="casque-scale")
    print("scale_model: starting a three-node ring ...", file=sys.stderr, flush=True)
    stack.up()
    payload = os.urandom(args.size)
    try:
        cassandra = f"127.0.0.1:{RING_PORTS.native}"
        store, settings = open_store(cassandra, stack.zookeeper_hosts, "LOCAL_QUORUM", 3)
        meter = Meter([pid for pid, _ in cassandra_nodes(RING_PORTS.native)], [], stack.zookeeper_hosts)
        try:
            warmup, large_q, small_q, check_q = (QueueRef("default", f"ring-{name}")
                                                 for name in ("warmup", "large", "small", "check"))
            for queue in (warmup, large_q, small_q, check_q):
                catalog.apply_queue(store, queue, QueueSpec(shards=args.shards, retention_seconds=3600))
            catalog.apply_subscriber(store, large_q, "model",
                                     SubscriberSpec(queue=large_q.name, start_position="earliest"))
            # Fresh JVMs: the JIT compiles the write path first, as on the one-node stack.
            await publish_phase(store, warmup, meter, args.messages // 2, 100, 32, payload)
            large, _ = await publish_phase(store, large_q, meter, args.messages // 2, 100, 32, payload)
            small, _ = await publish_phase(store, small_q, meter, args.messages // 4, 10, 64, payload)
            consume = await consume_phase(store, large_q, meter, large.messages)
            check, _ = await publish_phase(store, check_q, meter, args.messages // 10, 1, 64, payload)
        finally:
            drop_scratch(store, settings)
            store.close()
    finally:
        stack.down()
        shutil.rmtree(root, ignore_errors=True)
    claim, message = split_costs(large, small, "cassandra")
    naive_claim, naive_message = 3 * costs["claim_cpu_ms"] / 1000, 3 * costs["write_cpu_per_1000"] / 1e6
    costs.update({
        "ring_claim_cpu_ms": claim * 1000,
        "ring_write_cpu_per_1000": message * 1e6,
        "ring_read_cpu_per_1000": consume.per_message("cassandra") * 1e6,
        "ring_write_vs_naive": (claim / large.batch + message) / (naive_claim / large.batch + naive_message),
        "check_3_free_cores": free_cores(check),
        "check_3_predicted": host_prediction(costs, check.batch, claim, message, free_cores(check)),
        "check_3_naive_predicted": host_prediction(costs, check.batch, naive_claim, naive_message, free_cores(check)),
        "check_3_measured": check.rate,
        "check_3_batch": check.batch,
        "check_3_claim_ms": 1000 * check.shards * check.usage["seconds"] / max(1, check.batches),
        "check_3_busy": busy(check),
    })
    costs["check_3_ratio"] = check.rate / costs["check_3_predicted"]


def busy(phase: Phase) -> float:
    """Cores the host was busy during `phase`, on average."""
    return sum(phase.usage[k] for k in ("cassandra", "zookeeper", "client", "others")) / phase.usage["seconds"]


# --- the model ----------------------------------------------------------------------------

def replicas_for(nodes: int) -> int:
    return min(REPLICATION, nodes)


def batch_at(rate: float, shards: int, costs: dict[str, float]) -> float:
    """The group commit's batch size at `rate`: what arrives on a shard during one claim,
    at least one message, at most the batch limits."""
    arriving = rate / shards * costs["claim_ms"] / 1000
    return max(1.0, min(float(MAX_BATCH_MESSAGES), MAX_BATCH_BYTES / costs["size"], arriving))


def cpu_per_message(costs: dict[str, float], nodes: int, batch: float) -> float:
    """Cluster Cassandra CPU seconds per message: written on every replica (claim and rows),
    read and acked once per subscriber at a quorum of the replicas."""
    replicas = replicas_for(nodes)
    claim, message = write_costs(costs, replicas)
    return claim / batch + message + SUBSCRIBERS * read_cost(costs, replicas)


def shards_for(rate: float, costs: dict[str, float]) -> int:
    """Shards so that no shard needs full batches to keep up: each carries at most half of
    what full batches at the measured claim latency allow."""
    per_shard = min(MAX_BATCH_MESSAGES, MAX_BATCH_BYTES / costs["size"]) / (costs["claim_ms"] / 1000) / 2
    return max(4, math.ceil(rate / per_shard))


def zk_writes(rate: float, shards: int, costs: dict[str, float]) -> float:
    """ZooKeeper writes/s: per message at light load, but each shard's head and offset commits
    are coalesced, so no more than the per-shard ceiling measured at full load."""
    per_message = (costs["zk_writes_publish_per_1000"] + SUBSCRIBERS * costs["zk_writes_consume_per_1000"]) / 1000
    return min(rate * per_message, shards * costs["zk_writes_per_shard_s"] * SUBSCRIBERS)


def model_rates(costs: dict[str, float]) -> list[dict[str, Any]]:
    """For each target rate: what it takes, and the resource that runs out first."""
    rows = []
    for rate in RATES:
        shards = shards_for(rate, costs)
        batch = batch_at(rate, shards, costs)
        nodes_cpu = 1
        while nodes_cpu < 10_000:
            if rate * cpu_per_message(costs, nodes_cpu, batch) <= nodes_cpu * NODE_CORES * CPU_HEADROOM:
                break
            nodes_cpu += 1
        replicas = replicas_for(max(nodes_cpu, REPLICATION))
        stored = rate * RETENTION_S * costs["disk_bytes_per_msg"] * replicas * TWCS_OVERHANG
        nodes_disk = math.ceil(stored / DISK_PER_NODE)
        zk = zk_writes(rate, shards, costs)
        partition = BATCHES_PER_BUCKET * batch * costs["disk_bytes_per_msg"]
        limits = {"Cassandra CPU": nodes_cpu, "disk": nodes_disk}
        first = max(limits, key=lambda k: limits[k])
        rows.append({
            "rate": rate, "shards": shards, "batch": batch, "nodes": max(nodes_cpu, nodes_disk, 1),
            "nodes_cpu": nodes_cpu, "nodes_disk": nodes_disk, "zk_writes_s": zk,
            "zk_share": zk / ZK_WRITE_CEILING, "storage_tb_day": stored / 1e12, "partition_mb": partition / 1e6,
            "first": "ZooKeeper" if zk > ZK_WRITE_CEILING else first,
        })
    return rows


def model_nodes(costs: dict[str, float]) -> list[dict[str, Any]]:
    """For each cluster size: the msgs/s each resource allows, and the smallest."""
    rows = []
    for nodes in NODE_COUNTS:
        full_batch = min(float(MAX_BATCH_MESSAGES), MAX_BATCH_BYTES / costs["size"])
        # CPU at the batch size the rate itself brings (iterate: the batch grows with the rate).
        rate = 1000.0
        for _ in range(30):
            shards = shards_for(rate, costs)
            rate = nodes * NODE_CORES * CPU_HEADROOM / cpu_per_message(costs, nodes, batch_at(rate, shards, costs))
        disk_rate = nodes * DISK_PER_NODE / (RETENTION_S * costs["disk_bytes_per_msg"] * replicas_for(nodes)
                                             * TWCS_OVERHANG)
        shards = shards_for(rate, costs)
        zk = zk_writes(rate, shards, costs)
        # Past the ceiling, the rate ZooKeeper allows at the writes per message of this load.
        zk_rate = math.inf if zk <= ZK_WRITE_CEILING else rate * ZK_WRITE_CEILING / zk
        limits = {"Cassandra CPU": rate, "disk (1-day retention)": disk_rate, "ZooKeeper writes": zk_rate}
        first = min(limits, key=lambda k: limits[k])
        rows.append({"nodes": nodes, "replicas": replicas_for(nodes), "cpu_rate": rate, "disk_rate": disk_rate,
                     "zk_writes_s": zk_writes(min(limits.values()), shards, costs), "shards": shards,
                     "batch": batch_at(rate, shards, costs), "full_batch": full_batch,
                     "max_rate": limits[first], "first": first})
    return rows


# --- output -------------------------------------------------------------------------------

def number(value: float) -> str:
    if value == math.inf:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def render_tables(costs: dict[str, float], by_nodes: list[dict[str, Any]], by_rate: list[dict[str, Any]]) -> str:
    lines = ["| Cassandra nodes | replicas | msgs/s by CPU | msgs/s by disk | ZooKeeper writes/s | shards | "
             "runs out first |", "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in by_nodes:
        lines.append(f"| {row['nodes']} | {row['replicas']} | {number(row['cpu_rate'])} | {number(row['disk_rate'])} | "
                     f"{number(row['zk_writes_s'])} | {row['shards']} | {row['first']} |")
    lines += ["", "| msgs/s | nodes (CPU, disk) | shards | batch | ZooKeeper writes/s (share of ceiling) | "
              "storage per day | bucket partition | runs out first |",
              "| ---: | --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for row in by_rate:
        # One queue has at most MAX_SHARDS shards: past that, the load takes several queues.
        shards = f"{row['shards']}" + (f" (>{MAX_SHARDS}: several queues)" if row["shards"] > MAX_SHARDS else "")
        lines.append(
            f"| {row['rate']:,} | {row['nodes']} ({row['nodes_cpu']}, {row['nodes_disk']}) | {shards} | "
            f"{number(row['batch'])} | {number(row['zk_writes_s'])} ({row['zk_share']:.0%}) | "
            f"{row['storage_tb_day']:.2f} TB | {number(row['partition_mb'])} MB | {row['first']} |")
    return "\n".join(lines) + "\n"


def render_inputs(costs: dict[str, float]) -> str:
    rows = [(("&emsp;" if f.label.startswith(" ") else "") + f.label.strip(), costs[f.key], f.unit)
            for f in FIGURES if f.key in costs]
    lines = ["| input | value | unit |", "| --- | ---: | --- |"]
    lines += [f"| {label} | {number(value)} | {unit} |" for label, value, unit in rows]
    return "\n".join(lines) + "\n"


def write_docs(path: Path, costs: dict[str, float], context: dict[str, Any]) -> None:
    text = path.read_text()
    begin, end = "<!-- scale:begin -->", "<!-- scale:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} section to update")
    section = (f"Measured {context['date']} on {context['machine']} ({context['cores']} cores shared by every "
               f"process), {context['messages']:,} messages of {context['size']} bytes, {context['shards']} shards.\n\n"
               + render_inputs(costs) + "\n"
               + render_tables(costs, model_nodes(costs), model_rates(costs)))
    head, rest = text.split(begin, 1)
    path.write_text(f"{head}{begin}\n{section}{end}{rest.split(end, 1)[1]}")


async def main() -> None:
    parser = arguments(__doc__.splitlines()[0], 20000, 1024)
    parser.add_argument("--ring", action="store_true",
                        help="also check the model on a three-node ring it starts (minutes; not with --smoke)")
    parser.add_argument("--write-docs", type=Path, metavar="FILE", help="rewrite the tables of FILE (docs/scaling.md)")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="measure nothing: the inputs of an earlier --json run (to re-render the tables)")
    args = parse(parser, smoke_messages=600)
    args.runs = 1  # one measurement: the model's inputs are costs, not rates to take a median of
    if args.from_json is not None:
        earlier = json.loads(args.from_json.read_text())
        costs, context = earlier["model"]["inputs"], earlier["context"]
    else:
        costs = await measure(args)
        if args.ring and not args.smoke:
            await ring_check(args, costs)
        context = {"messages": args.messages, "size": args.size, "shards": args.shards, "cores": os.cpu_count(),
                   "machine": f"{platform.machine()} {platform.processor() or platform.node()}".strip(),
                   "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    if args.write_docs is not None:
        write_docs(args.write_docs, costs, context)
        print(f"scale_model: updated {args.write_docs}", file=sys.stderr)
    samples = {f.key: [costs[f.key]] for f in FIGURES if f.key in costs}
    model = {"inputs": costs, "assumptions": ASSUMPTIONS, "by_nodes": model_nodes(costs),
             "by_rate": model_rates(costs)}
    if args.json:
        with redirect_stdout(io.StringIO()) as captured:
            report("scale_model", args, context, FIGURES, samples)
        document = json.loads(captured.getvalue())
        document["model"] = model
        print(json.dumps(document, indent=1, default=lambda v: None if v == math.inf else v))
        return
    report("scale_model", args, context, FIGURES, samples)
    print()
    print(render_tables(costs, model["by_nodes"], model["by_rate"]))
    print("assumptions: " + ", ".join(f"{k} {v}" for k, v in ASSUMPTIONS.items()))


if __name__ == "__main__":
    asyncio.run(main())
