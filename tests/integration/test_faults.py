"""Faults the seed designs worry about, injected into the real servers.

A history checker reads the whole log back and proves: nothing acknowledged is lost,
nothing is stored twice, nothing is stored that was not published, and batches never merge.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile

from casque.backends import cql as cql_backend
from casque.devstack import processes
from casque.engine import catalog
from casque.engine.batches import Log
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage, Published
from casque.engine.publisher import Publisher
from casque.engine.sequences import producer_key
from casque.errors import BackendUnavailable
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient, ApiError
from tests.fixtures.group import assert_sound
from tests.fixtures.history import Ack, Delivery, History, delivered_behind_acked_successors
from tests.fixtures.sidecars import StartSidecar
from tests.fixtures.stack import Backends

QUEUE = QueueRef("default", "faults")
ROOT = Path(__file__).resolve().parents[2]


def needs_own_stack(backends: Backends) -> None:
    if backends.stack is None:
        pytest.skip("injects faults into the servers the test session started itself")


def process_state(directory: Path) -> str:
    """The state letter /proc shows for the process of `directory` ("T" while stopped)."""
    pid = processes.running_pid(directory)
    if pid is None:
        return "gone"
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]


async def read_log(store: Store, spec: QueueSpec) -> dict[tuple[int, int], list[tuple[str, bytes]]]:
    """(shard, batch) -> [(message id, payload)] for every batch in the log, checking contiguity."""
    log = Log(store, QUEUE, "ONE")
    found: dict[tuple[int, int], list[tuple[str, bytes]]] = {}
    for shard in range(spec.shards):
        batch = 1
        while True:
            chunk = await log.read_from(shard, batch)
            if not chunk:
                break
            for b in chunk:
                assert b.header.batch == batch, f"gap before batch {shard}/{b.header.batch}"
                assert len(b.messages) == b.header.message_count, "a batch is incomplete"
                found[(shard, batch)] = [(m.message_id, m.payload) for m in b.messages]
                batch += 1
        head = catalog.read_int(store, store.paths(QUEUE).head(shard))
        assert head <= batch - 1, "the head points past the log"
    return found


def check_history(
    stored: dict[tuple[int, int], list[tuple[str, bytes]]],
    acked: dict[str, tuple[int, int, int]],
    writer_of: Callable[[bytes], str],
    published_payloads: set[bytes],
) -> None:
    seen: dict[str, tuple[int, int, int]] = {}
    for (shard, batch), messages in stored.items():
        writers = {writer_of(payload) for _, payload in messages}
        assert len(writers) <= 1, f"batch {shard}/{batch} merges writers {writers}"
        for seq, (message_id, payload) in enumerate(messages):
            assert payload in published_payloads, f"stored but never published: {payload!r}"
            assert message_id not in seen, f"{message_id} stored twice"
            seen[message_id] = (shard, batch, seq)
    for message_id, position in acked.items():
        assert seen.get(message_id) == position, f"acknowledged {message_id} lost or moved"


async def test_paused_publisher_with_expired_session_cannot_corrupt_batches(
    backends: Backends, store: Store, zk_hosts: str
) -> None:
    needs_own_stack(backends)
    spec = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    cassandra = f"{backends.contact_points[0]}:{backends.cql_port}"

    def start(name: str, count: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.integration.fault_publisher", name, str(count), store.keyspace,
             cassandra, zk_hosts],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )

    paused = start("paused", 200)
    first_lines = [paused.stdout.readline() for _ in range(20)] if paused.stdout else []
    assert all(first_lines), "the publisher to pause did not publish"
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        # Its ZooKeeper session expires while it is stopped.
        deadline = time.monotonic() + 60
        while store.zk.exists("/alive/paused"):
            assert time.monotonic() < deadline, "session did not expire"
            await asyncio.sleep(0.1)
        rival = start("rival", 150)
        rival_out, _ = await asyncio.to_thread(rival.communicate, timeout=300)
        assert rival.returncode == 0
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    paused_rest, _ = await asyncio.to_thread(paused.communicate, timeout=300)
    assert paused.returncode == 0

    lines = [json.loads(line) for line in "".join(first_lines).splitlines() + paused_rest.splitlines()
             + rival_out.splitlines() if line.strip()]
    acked = {line["id"]: (line["shard"], line["batch"], line["seq"]) for line in lines}
    assert sum(1 for line in lines if line["payload"].startswith("paused-")) > 20  # it went on after resuming
    published = {f"paused-{i}".encode() for i in range(200)} | {f"rival-{i}".encode() for i in range(150)}
    stored = await read_log(store, spec)
    check_history(stored, acked, lambda payload: payload.split(b"-")[0].decode(), published)


async def test_cassandra_timeout_is_retryable_and_loses_nothing_acknowledged(
    backends: Backends, store: Store, cql: object
) -> None:
    needs_own_stack(backends)
    assert backends.stack is not None
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    impatient = Cluster(
        backends.contact_points, port=backends.cql_port, sockopts=cql_backend.SOCKET_OPTIONS,
        execution_profiles={EXEC_PROFILE_DEFAULT: ExecutionProfile(request_timeout=1.0)},
    )
    session = impatient.connect()
    fast_store = Store(session, store.zk, store.keyspace, store.zk_root, store.replication_cql)
    publisher = Publisher(fast_store, QUEUE, catalog.read_queue(fast_store, QUEUE))
    node_dir = backends.stack.cassandra_nodes()[0].directory
    acked: dict[str, tuple[int, int, int]] = {}
    failures = 0
    payloads: set[bytes] = set()

    async def publish(i: int) -> None:
        nonlocal failures
        payload = f"w-{i}".encode()
        payloads.add(payload)
        try:
            (result,) = await publisher.publish([OutgoingMessage(payload)])
        except BackendUnavailable:
            failures += 1
            return
        acked[result.message_id] = (result.shard, result.batch, result.seq)

    try:
        await asyncio.gather(*(publish(i) for i in range(100)))
        processes.pause(node_dir)
        paused_at = time.monotonic()
        try:
            await asyncio.gather(*(publish(i) for i in range(100, 150)))
            state_after = process_state(node_dir)
        finally:
            processes.resume(node_dir)
        assert failures > 0, (f"the pause produced no timeout: 50 publishes took {time.monotonic() - paused_at:.1f}s, "
                              f"Cassandra's state after them {state_after!r}")
        # Once Cassandra answers again, publishing works again.
        deadline = time.monotonic() + 120
        while True:
            before = len(acked)
            await publish(1000 + len(payloads))
            if len(acked) > before:
                break
            assert time.monotonic() < deadline, "publishing did not recover"
        await asyncio.gather(*(publish(i) for i in range(2000, 2100)))
        stored = await read_log(fast_store, spec)
        check_history(stored, acked, lambda payload: "one writer", payloads)
        assert len(acked) >= 200
    finally:
        impatient.shutdown()


async def test_zookeeper_restart_loses_no_acknowledged_message(
    backends: Backends, store: Store, zk_hosts: str
) -> None:
    needs_own_stack(backends)
    assert backends.stack is not None
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    catalog.apply_subscriber(store, QUEUE, "survivor", SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    consumer = Consumer(store, QUEUE, "survivor")
    await consumer.start()
    published: set[str] = set()

    async def publish(n: int, prefix: str) -> None:
        results = await asyncio.gather(*(publisher.publish([OutgoingMessage(f"{prefix}{i}".encode())]) for i in range(n)))
        published.update(r[0].message_id for r in results)

    received: set[str] = set()

    async def consume_until(count: int) -> None:
        deadline = time.monotonic() + 120
        while len(received) < count:
            assert time.monotonic() < deadline, f"only {len(received)} of {count} received"
            try:
                for d in await consumer.receive(max_messages=50, wait=1):
                    await consumer.ack(d.receipt)
                    received.add(d.message.message_id)
            except BackendUnavailable:
                await asyncio.sleep(0.2)

    try:
        await publish(100, "before-")
        await consume_until(50)
        zookeeper = backends.stack.zookeeper()
        await asyncio.to_thread(zookeeper.stop)
        await publish(50, "during-")  # publishing needs only Cassandra
        await asyncio.to_thread(zookeeper.start)
        await asyncio.to_thread(zookeeper.wait_ready)
        await publish(50, "after-")
        await consume_until(len(published))
        assert received == published
    finally:
        await consumer.stop()


def keyed_body(kind: str, chunk: str, number: int, **fields: object) -> tuple[str, dict[str, object]]:
    """A publish body keyed by an `id`, or by a producer id and number (the app client's
    default): the key as the log stores it, and the body."""
    if kind == "id":
        key = f"{chunk}-{number}"
        return key, {"id": key, **fields}
    return producer_key(f"p{chunk}", number), {"producerid": f"p{chunk}", "producerseq": number, **fields}


@pytest.mark.parametrize("kind", ["id", "producer"])
async def test_publishes_cut_by_a_sidecar_killed_mid_write_land_once(
    backends: Backends, store: Store, start_sidecar: StartSidecar, kind: str
) -> None:
    """The issue's repro: a sidecar killed with -9 while many of its batch writes are under
    way (some written, not yet answered); the client retries every unanswered publish, same
    keys, through another sidecar. Each key must be in the log exactly once, where its answer
    says. Several rounds, each killing at whatever moment the first answer comes back."""
    needs_own_stack(backends)
    spec = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    catalog.apply_queue(store, QUEUE, spec)
    survivor = start_sidecar()
    answered: dict[str, tuple[int, int, int]] = {}
    every_id: set[str] = set()

    async def publish(url: str, chunk: list[tuple[str, dict[str, object]]]) -> bool:
        """A chunk of (key as stored, body): whether it was answered."""
        try:
            bodies = {"messages": [body for _, body in chunk]}
            async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=90)) as http:
                async with http.post(f"/v1/queues/{QUEUE.name}/messages/batch", json=bodies) as answer:
                    if answer.status != 200:
                        return False
                    results = (await answer.json())["results"]
        except (aiohttp.ClientError, TimeoutError):
            return False
        for (key, _), result in zip(chunk, results):
            answered[key] = (result["shard"], result["batch"], result["seq"])
        return True

    for round_ in range(4):
        doomed = await asyncio.to_thread(start_sidecar)
        chunks = [[keyed_body(kind, f"r{round_}-{c}", i, data=i, partitionkey=f"k{c}") for i in range(10)]
                  for c in range(48)]
        every_id |= {key for chunk in chunks for key, _ in chunk}
        pending = [asyncio.create_task(publish(doomed.url, chunk)) for chunk in chunks]
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        doomed.kill()  # the others are somewhere between their id check and their answer
        await asyncio.gather(*pending)
        for chunk in chunks:
            if all(key in answered for key, _ in chunk):
                continue
            deadline = time.monotonic() + 180
            while not await publish(survivor.url, chunk):  # the client's retry, same keys
                assert time.monotonic() < deadline, "the retry was never answered"

    rows = store.session.execute(f"SELECT client_id, shard, batch_no, seq FROM {store.table(QUEUE)}")
    stored: dict[str, list[tuple[int, int, int]]] = {}
    for row in rows:
        if row.client_id:
            stored.setdefault(row.client_id, []).append((row.shard, row.batch_no, row.seq))
    assert set(answered) == every_id
    twice = {i: places for i, places in stored.items() if len(places) > 1}
    assert not twice, f"{len(twice)} ids stored twice, e.g. {list(twice.items())[:2]}"
    assert {i: places[0] for i, places in stored.items()} == answered


async def test_acks_resent_after_timed_out_writes_are_answered_only_when_durable(
    backends: Backends, store: Store, zk_hosts: str
) -> None:
    """Ack rows whose writes time out at the driver (some landed, some never sent), the acks
    sent again as the app client does until answered, then kill -9: no message is delivered
    after an ack of it was answered `acked` or `already_acked`. Batches are left open (10 of
    37 acked a call), so only the ack rows can make those acks durable."""
    queue = QueueRef("default", "ackdie")  # tests.integration.ack_then_die consumes it
    history, _ = await _published(store, queue, 1, [[OutgoingMessage(f"m{n}-{i}".encode()) for i in range(37)]
                                                    for n in range(4)])

    cassandra = f"{backends.contact_points[0]}:{backends.cql_port}"
    for ack_calls in (2, 3):
        await _run_victim(history, [store.keyspace, cassandra, zk_hosts, str(ack_calls), "10", "timeouts"])
    assert any(a.outcome == "backend_unavailable" for a in history.acks), "no ack write timed out"
    await _consume_the_rest(store, queue, history)
    assert_sound(history)


async def test_an_ordered_key_moves_on_only_when_the_ack_before_is_durable(
    backends: Backends, store: Store, zk_hosts: str
) -> None:
    """orderedKeys with ack-row writes that time out and acks sent again, then kill -9: a key's
    next message is never handed out before its previous one's ack is durable, so no message
    comes again after a later message of its key was acked (read from the recorded history)."""
    queue = QueueRef("default", "ackdie")  # tests.integration.ack_then_die consumes it
    # Batches of 200, 20 messages of each of 10 keys: a call of 10 takes one of each key, and
    # no batch completes in the victims' calls (an offset write past it would cover lost rows).
    history, batches = await _published(store, queue, 1, [
        [OutgoingMessage(f"m{n}-{i}".encode(), key=f"k{i % 10}") for i in range(200)] for n in range(2)],
        ordered_keys=True)
    keys = {result.message_id: (f"k{i % 10}", n * 20 + i // 10)
            for n, results in enumerate(batches) for i, result in enumerate(results)}

    cassandra = f"{backends.contact_points[0]}:{backends.cql_port}"
    for ack_calls in (4, 5):
        await _run_victim(history, [store.keyspace, cassandra, zk_hosts, str(ack_calls), "10", "timeouts"])
    assert any(a.outcome == "backend_unavailable" for a in history.acks), "no ack write timed out"
    await _consume_the_rest(store, queue, history)
    behind = delivered_behind_acked_successors(history, keys)
    assert not behind, f"{len(behind)} deliveries behind an acked successor, e.g. {behind[:2]}"
    assert_sound(history)


async def test_the_app_clients_resent_acks_after_timed_out_writes_hold_across_a_kill(
    store: Store, start_sidecar: StartSidecar
) -> None:
    """The app client's own retry path under a history check: a sidecar whose ack-row writes
    time out at the driver answers 503, casque-client sends the ack again, and the answer it
    finally returns (`acked` or `already_acked`) holds after the sidecar is killed with -9:
    nothing acked comes back to the next member. Batches are left open, so only the ack rows
    can make those acks durable."""
    queue = QueueRef("default", "clientacks")
    history, _ = await _published(store, queue, 1, [[OutgoingMessage(f"m{n}-{i}".encode()) for i in range(100)]
                                                    for n in range(2)])

    sidecar = start_sidecar("--queue", queue.name, "--subscriber", "workers", module="tests.integration.flaky_sidecar")
    member = sidecar.member("workers") or "flaky"
    async with AsyncClient(sidecar.url, queue=queue.name, subscriber="workers") as app:
        while len(history.acks) < 30:
            sent = History.now()
            messages = await app.receive(max=10, wait=5)
            answered = History.now()
            history.deliveries.extend(Delivery(m.message_id, m.receipt, member, m.delivery_count, sent, answered)
                                      for m in messages)
            for m in messages:
                sent = History.now()
                try:
                    outcome = await app.ack(m.receipt)  # a 503 is sent again by the client itself
                except ApiError as error:
                    outcome = error.code
                history.acks.append(Ack(m.message_id, m.receipt, outcome, sent, History.now()))
    async with aiohttp.ClientSession() as http, http.get(f"{sidecar.url}/metrics") as answer:
        metrics = await answer.text()
    sidecar.kill()
    assert 'casque_sidecar_requests_total{operation="ack",status="503"}' in metrics, "no ack was answered 503"
    await _consume_the_rest(store, queue, history)
    assert_sound(history)


async def _published(
    store: Store, queue: QueueRef, shards: int, calls: list[list[OutgoingMessage]], ordered_keys: bool = False
) -> tuple[History, list[list[Published]]]:
    """A queue with the subscriber `workers` (visibility 60 s), and `calls` published to it, one
    call each (one batch on one shard): a history of those publishes and their results."""
    catalog.apply_queue(store, queue, QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, queue, "workers", SubscriberSpec(
        queue=queue.name, start_position="earliest", visibility_timeout_seconds=60, ordered_keys=ordered_keys))
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    history = History()
    results = []
    for messages in calls:
        results.append(await publisher.publish(messages))
        answered = History.now()
        history.published.update((r.message_id, answered) for r in results[-1])
    await publisher.flush_heads()
    return history, results


async def _run_victim(history: History, arguments: list[str]) -> list[dict[str, object]]:
    """Run tests.integration.ack_then_die to its SIGKILL and add what it saw to `history`."""
    victim = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "tests.integration.ack_then_die", *arguments],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert victim.returncode == -signal.SIGKILL, victim.stderr[-2000:]
    lines = [json.loads(line) for line in victim.stdout.splitlines() if line.strip()]
    member = lines[0]["member"]
    for line in lines[1:]:
        if line["kind"] == "delivery":
            history.deliveries.append(Delivery(line["id"], line["receipt"], member, line["count"],
                                               line["sent"], line["answered"]))
        else:
            history.acks.append(Ack(line["id"], line["receipt"], line["outcome"], line["sent"], line["answered"]))
    return lines


async def _consume_the_rest(store: Store, queue: QueueRef, history: History) -> None:
    """Receive and ack as a new member until every published message is settled."""
    consumer = Consumer(store, queue, "workers")
    await consumer.start()
    try:
        while not set(history.published) <= history.settled_ids():
            sent = History.now()
            deliveries = await consumer.receive(max_messages=100, wait=30)
            answered = History.now()
            assert deliveries, "the last victim's leases were never freed"
            history.deliveries.extend(Delivery(d.message.message_id, d.receipt, consumer.member_id, d.delivery_count,
                                               sent, answered) for d in deliveries)
            sent = History.now()
            results = await consumer.ack_many([d.receipt for d in deliveries])
            answered = History.now()
            history.acks.extend(Ack(d.message.message_id, d.receipt, "acked" if r is True else "already_acked",
                                    sent, answered) for d, r in zip(deliveries, results) if isinstance(r, bool))
    finally:
        await consumer.stop()


async def test_acks_answered_before_a_kill_are_never_delivered_again(
    backends: Backends, store: Store, zk_hosts: str
) -> None:
    """A consumer killed with SIGKILL the instant an ack call is answered loses none of those
    acks: whether its lease was proven locally or by ZooKeeper, nothing it answered `acked`
    reaches the next member (checked by the history checker)."""
    queue = QueueRef("default", "ackdie")  # tests.integration.ack_then_die consumes it
    # Batches of 37. Ack calls of 37 first, one whole batch each, whose lease check after the
    # row asks ZooKeeper (told to: the lease is proven locally otherwise). Then calls of 100:
    # each completes some batches and leaves one open.
    history, _ = await _published(store, queue, 2, [[OutgoingMessage(f"m{n}-{i}".encode()) for i in range(37)]
                                                    for n in range(40)])

    cassandra = f"{backends.contact_points[0]}:{backends.cql_port}"
    for ack_calls, per_call in ((2, 37), (5, 37), (1, 100), (3, 100)):
        lines = await _run_victim(history, [store.keyspace, cassandra, zk_hosts, str(ack_calls), str(per_call),
                                            *(["zk-check"] if per_call == 37 else [])])
        assert sum(1 for line in lines if line.get("outcome") == "acked") >= per_call * (ack_calls - 1)

    await _consume_the_rest(store, queue, history)
    assert_sound(history)
