"""Records of a later format than this version reads, crafted, and refused by each reader with a
clear error rather than misread: the queue's and subscriber's znode data (a sidecar: 503
`newer_format` and not ready, saying why), a head and an offset (the same), the
installation's protocol version (a sidecar, as
the same, then serving once it is lowered), the catalog and checkpoint rows (an apply that
would rebuild from them), a backup's manifest (a restore); and the records whose format
rides on a field of theirs (casque.formats): a batch, an ack row, a publish-id record and
a receipt of another length (a sidecar's reads, retries, acks and history)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from casque.engine import catalog, checkpoints, protocol
from casque.engine.rebuild import rebuild_queue
from casque.errors import NewerFormat
from casque.schema import (ACKS_TABLE, CATALOG_TABLE, CHECKPOINTS_TABLE, CLIENT_IDS_TABLE, HEADER_SEQ, QueueRef,
                           bucket_of, client_id_bucket)
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.sidecars import StartSidecar
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for

QUEUE = QueueRef("default", "parcels")
SPEC = QueueSpec(shards=1, retention_seconds=3600, consistency="ONE")


def later(data: bytes) -> bytes:
    return json.dumps({**json.loads(data), "format": 99}).encode()


def test_a_sidecar_refuses_a_queue_written_in_a_later_format_and_says_so(
    store: Store, start_sidecar: StartSidecar
) -> None:
    catalog.apply_queue(store, QUEUE, SPEC)
    catalog.apply_subscriber(store, QUEUE, "couriers", SubscriberSpec(queue=QUEUE.name))
    path = store.paths(QUEUE).base
    data, _ = store.zk.get(path)
    store.zk.set(path, later(data))
    sidecar = start_sidecar("--queue", QUEUE.name, "--subscriber", "couriers", wait=False)

    def refusing() -> bool:
        return "NewerFormat" in sidecar.readiness()[1].get("checks", {}).get("subscriber/couriers", "")

    wait_for("the sidecar to refuse the queue's state", refusing, timeout=60)
    request = urllib.request.Request(f"{sidecar.url}/v1/queues/{QUEUE.name}/messages", method="POST",
                                     data=b'{"data": 1}', headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=30)
    assert answer.value.code == 503
    assert json.loads(answer.value.read())["error"]["code"] == "newer_format"
    status, body = sidecar.readiness()
    assert status == 503
    assert "format 99; this version of casque reads up to 1" in body["checks"]["subscriber/couriers"]


def call(url: str, path: str, body: dict[str, object] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a POST of `body` (a GET without one) to the sidecar at `url`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def publish_answer(url: str) -> tuple[int, dict[str, Any]]:
    return call(url, f"/v1/queues/{QUEUE.name}/messages", {"data": 1, "producerid": "p", "producerseq": 1})


def test_a_sidecar_refuses_positions_of_a_later_format_and_says_which(
    store: Store, start_sidecar: StartSidecar
) -> None:
    """A head and an offset marked with a later format (as a rollback would find them): the
    sidecar neither publishes on the head nor reads from the offset as if they were numbers
    of its own format; it answers `newer_format` and its readiness names the offset."""
    catalog.apply_queue(store, QUEUE, SPEC)
    catalog.apply_subscriber(store, QUEUE, "couriers", SubscriberSpec(queue=QUEUE.name))
    paths = store.paths(QUEUE)
    store.zk.set(paths.head(0), b"0#2")
    store.zk.set(paths.subscriber("couriers").offset(0), b"1@0#2")
    sidecar = start_sidecar("--queue", QUEUE.name, "--subscriber", "couriers", wait=False)

    def refusing() -> bool:
        return "format 2" in sidecar.readiness()[1].get("checks", {}).get("subscriber/couriers", "")

    wait_for("the sidecar to refuse the shard's offset", refusing, timeout=60)
    assert "an offset or cursor '1@0' was written in format 2" in sidecar.readiness()[1]["checks"]["subscriber/couriers"]
    status, body = publish_answer(sidecar.url)
    assert status == 503 and body["error"]["code"] == "newer_format", body  # type: ignore[index]
    assert "a head '0' was written in format 2" in body["error"]["message"]  # type: ignore[index]


def test_a_sidecar_writes_nothing_in_a_protocol_above_its_own_and_serves_once_it_is_lowered(
    store: Store, start_sidecar: StartSidecar
) -> None:
    """An installation moved (with --force) to a protocol this release does not speak: its
    sidecars publish nothing, rather than write records their peers would misread, and say
    why in readiness; they follow the znode back down without a restart."""
    catalog.apply_queue(store, QUEUE, SPEC)
    sidecar = start_sidecar()
    status, first = publish_answer(sidecar.url)
    assert status == 200 and first["duplicate"] is False
    path = protocol.protocol_path(store.zk_root)
    store.zk.create(path, json.dumps({"format": 1, "version": protocol.PROTOCOL + 1}).encode(), makepath=True)
    wait_for("the sidecar to refuse the protocol", lambda: "protocol" in sidecar.readiness()[1].get("checks", {}),
             timeout=60)
    status, body = sidecar.readiness()
    assert status == 503
    assert f"speaks up to {protocol.PROTOCOL}: upgrade it" in str(body["checks"]["protocol"])  # type: ignore[index]
    status, answer = publish_answer(sidecar.url)
    assert status == 503 and answer["error"]["code"] == "newer_format"  # type: ignore[index]
    store.zk.set(path, json.dumps({"format": 1, "version": protocol.PROTOCOL}).encode())
    wait_for("the sidecar to serve again", lambda: sidecar.readiness()[0] == 200, timeout=60)
    status, answer = publish_answer(sidecar.url)
    # The first publish, found again: the sidecar reads records of both protocols.
    assert status == 200 and answer["duplicate"] is True and answer["messageId"] == first["messageId"]


def test_an_apply_refuses_to_rebuild_from_catalog_or_checkpoint_rows_of_a_later_format(store: Store) -> None:
    catalog.apply_queue(store, QUEUE, SPEC)
    state = catalog.read_queue(store, QUEUE)
    store.session.execute(f"UPDATE {store.keyspace}.{CATALOG_TABLE} SET format = 99 WHERE queue = %s "
                          "AND subscriber = %s", (QUEUE.key, checkpoints.QUEUE_RECORD))
    store.zk.delete(store.paths(QUEUE).base, recursive=True)  # ZooKeeper lost it
    with pytest.raises(NewerFormat, match="catalog record of queue default/parcels was written in format 99"):
        catalog.apply_queue(store, QUEUE, SPEC)
    assert not store.zk.exists(store.paths(QUEUE).base), "nothing is made from a record it cannot read"
    checkpoints.record_queue(store, QUEUE, state)  # the record readable again; a head's checkpoint is not
    store.session.execute(
        f"INSERT INTO {store.keyspace}.{CHECKPOINTS_TABLE} (queue, owner, shard, epoch, batch_no, format) "
        "VALUES (%s, %s, 0, 0, 7, 99) USING TIMESTAMP 7", (state.shared_key(QUEUE), checkpoints.HEAD))
    with pytest.raises(NewerFormat, match="checkpoint of the head in shard 0 was written in format 99"):
        rebuild_queue(store, QUEUE, state)


def test_a_restore_refuses_a_backup_of_a_later_format_in_one_line(
    store: Store, backends: Backends, keyspace: str, zk_hosts: str, tmp_path: Path
) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 99, "installationKeyspace": keyspace}))
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    done = subprocess.run([sys.executable, "-m", "casque.cli", "restore", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"casque: the backup in {tmp_path} is in format 99; this version of casque restores up to 1"]


def test_a_sidecar_leaves_batches_ack_rows_publish_ids_and_receipts_of_a_later_format_unread_and_says_which(
    store: Store, start_sidecar: StartSidecar
) -> None:
    """A batch whose writer is marked with a later format (casque.formats), an ack row of a later
    kind, a publish-id record whose writer is marked and a receipt of a later format, as a
    rollback would meet them: nothing of them is delivered, taken as done or answered from;
    each reader says which record and format, in readiness, the answer, and a metric."""
    catalog.apply_queue(store, QUEUE, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    for name in ("couriers", "sorters"):
        catalog.apply_subscriber(store, QUEUE, name, SubscriberSpec(queue=QUEUE.name))
    publisher = start_sidecar()
    placed: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for n in range(12):
        status, answer = call(publisher.url, f"/v1/queues/{QUEUE.name}/messages",
                              {"data": n, "id": f"parcel-{n}", "partitionkey": f"k{n}"})
        assert status == 200, answer
        placed[answer["shard"]].append({**answer, "id": f"parcel-{n}"})
    assert placed[0] and placed[1], "both shards hold messages"
    keyspace, table = store.keyspace, QUEUE.messages_table
    later_batch = placed[1][0]["batch"]  # shard 1's first batch, its writer marked with format 2
    (writer,) = store.session.execute(
        f"SELECT writer FROM {keyspace}.{table} WHERE shard = 1 AND bucket = %s AND batch_no = %s AND seq = %s",
        (bucket_of(later_batch), later_batch, HEADER_SEQ)).one()
    store.session.execute(
        f"UPDATE {keyspace}.{table} SET writer = %s WHERE shard = 1 AND bucket = %s AND batch_no = %s AND seq = %s",
        (f"{writer}#2", bucket_of(later_batch), later_batch, HEADER_SEQ))
    # An ack row of a later format for sorters on shard 0's first message.
    first = placed[0][0]
    sorters = catalog.read_subscriber(store, QUEUE, "sorters")
    store.session.execute(
        f"INSERT INTO {keyspace}.{ACKS_TABLE} (queue, subscriber, epoch, shard, bucket, batch_no, entry, outcome, "
        "seqs) VALUES (%s, %s, 0, 0, %s, %s, now(), 'ack#2', {0})",
        (QUEUE.key, sorters.ack_key("sorters"), bucket_of(first["batch"]), first["batch"]))
    # A publish-id record whose writer is marked.
    retried = placed[0][-1]
    store.session.execute(
        f"UPDATE {keyspace}.{CLIENT_IDS_TABLE} SET writer = 'p/0#2' WHERE queue = %s AND bucket = %s "
        "AND client_id = %s", (catalog.read_queue(store, QUEUE).shared_key(QUEUE), client_id_bucket(retried["id"]),
                               retried["id"]))

    couriers = start_sidecar("--queue", QUEUE.name, "--subscriber", "couriers", wait=False, env={
        "CASQUE_SIDECAR_METRICS_PORT": "0", "CASQUE_SIDECAR_METRICS_HOST": "127.0.0.1"})
    sorting = start_sidecar("--queue", QUEUE.name, "--subscriber", "sorters", wait=False)

    def check(sidecar: Any, name: str) -> str:
        return str(sidecar.readiness()[1].get("checks", {}).get(f"subscriber/{name}", ""))

    wait_for("couriers to refuse shard 1's batch", lambda: "format 2" in check(couriers, "couriers"), timeout=60)
    assert f"batch {later_batch}'s writer '{writer}' was written in format 2" in check(couriers, "couriers")
    wait_for("sorters to refuse the ack row", lambda: "an ack row" in check(sorting, "sorters"), timeout=60)
    assert "an ack row of kind 'ack' was written in format 2" in check(sorting, "sorters")

    # couriers gets shard 0's messages and none of shard 1's; sorters none (shard 0's ack row is
    # not taken as done, nor as a delivery; shard 1 as for couriers).
    got: list[dict[str, Any]] = []
    path = f"/v1/queues/{QUEUE.name}/subscribers/couriers/receive"
    while len(got) < len(placed[0]):
        status, answer = call(couriers.url, path, {"max": 100, "wait": 5})
        assert status == 200, answer
        got.extend(answer["messages"])
    assert sorted(m["id"] for m in got) == sorted(m["id"] for m in placed[0])
    status, answer = call(couriers.url, path, {"max": 100, "wait": 1})
    assert (status, answer["messages"]) == (200, [])
    status, answer = call(sorting.url, f"/v1/queues/{QUEUE.name}/subscribers/sorters/receive", {"max": 100, "wait": 1})
    assert (status, answer["messages"]) == (200, [])

    # A receipt of another length (a later format's) in a list: not one this release reads, and
    # the list's other receipt acked beside it.
    longer = base64.urlsafe_b64encode(bytes([2]) + bytes(30)).decode().rstrip("=")
    status, answer = call(couriers.url, f"/v1/queues/{QUEUE.name}/subscribers/couriers/ack",
                          {"receipts": [longer, got[0]["receipt"]]})
    assert status == 200, answer
    assert [r.get("error", {}).get("code") or r.get("status") for r in answer["results"]] == [
        "invalid_receipt", "acked"], answer
    # A retried publish whose record is marked: 503, named.
    status, answer = call(couriers.url, f"/v1/queues/{QUEUE.name}/messages",
                          {"data": 0, "id": retried["id"], "partitionkey": "k"})
    assert (status, answer.get("error", {}).get("code")) == (503, "newer_format"), answer
    assert f"the writer of publish id {retried['id']!r} 'p/0' was written in format 2" in answer["error"]["message"]
    # The history of a message in the refused batch.
    status, answer = call(couriers.url, f"/v1/queues/{QUEUE.name}/messages/{placed[1][0]['messageId']}")
    assert (status, answer.get("error", {}).get("code")) == (503, "newer_format"), answer

    with urllib.request.urlopen(couriers.metrics_url(), timeout=30) as scraped:
        refusals = [line for line in scraped.read().decode().splitlines()
                    if line.startswith("casque_sidecar_newer_format_refusals_total ")]
    assert refusals and float(refusals[0].split()[1]) >= 3, refusals
