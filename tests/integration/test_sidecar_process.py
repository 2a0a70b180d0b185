"""The sidecar as a real process (`casque sidecar`): fuzzed from its own OpenAPI document,
killed with SIGKILL, stopped with SIGTERM. Nothing acknowledged may be lost."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from casque.engine import catalog
from casque.engine.stats import queue_stats
from casque.schema import QueueRef
from casque.sidecar.memory_report import SNAPSHOT_SUFFIX, growth
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.sidecars import SidecarProcess

QUEUE = "jobs"
SUBSCRIBER = "workers"
REF = QueueRef("default", QUEUE)
SUB = f"/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}"


def create_queue(store: Store, shards: int = 2, visibility: int = 30) -> None:
    catalog.apply_queue(store, REF, QueueSpec(shards=shards, retention_seconds=3600, consistency="ONE",
                                              max_message_bytes=4096))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=visibility))


async def test_a_killed_sidecar_loses_no_acknowledged_message(
    store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    create_queue(store, shards=4)
    first = start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER)
    async with AsyncClient(first.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        published: set[str] = set()
        for start in range(0, 300, 50):
            results = await client.publish_batch([{"data": i, "partitionkey": f"k{i}"} for i in range(start, start + 50)])
            published.update(r.message_id for r in results)
        taken = await client.receive(max=60, wait=10)
        assert taken
        acked = {m.message_id for m in taken[::2]}
        outcomes = await client.ack_batch([m.receipt for m in taken[::2]])
        assert all(o.status == "acked" for o in outcomes)

    first.process.send_signal(signal.SIGKILL)  # no drain, no lease release, no offset flush
    assert await asyncio.to_thread(first.process.wait, 30) == -signal.SIGKILL

    second = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", SUBSCRIBER)
    got: list[str] = []
    async with AsyncClient(second.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        deadline = time.monotonic() + 90  # the dead sidecar's leases go when its session expires
        while set(got) != published - acked and time.monotonic() < deadline:
            messages = await client.receive(max=100, wait=2)
            if messages:
                await client.ack_batch([m.receipt for m in messages])
            got.extend(m.message_id for m in messages)
    assert set(got) == published - acked  # every published message not acked came back...
    assert not set(got) & acked  # ...and none that was acked before the kill


async def test_sigterm_drains_takes_acks_for_held_messages_and_releases_leases(
    store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    create_queue(store, shards=2)
    sidecar = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", SUBSCRIBER,
                                      "--drain-seconds", "60")
    async with AsyncClient(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        await client.publish_batch([{"data": i} for i in range(4)])
        held = []
        while len(held) < 4:
            held.extend(await client.receive(max=4, wait=5))
    sidecar.process.send_signal(signal.SIGTERM)

    async with aiohttp.ClientSession(sidecar.url) as http:  # no client retries: see the 503 itself
        async def draining() -> bool:
            async with http.get("/healthz") as answer:
                return (await answer.json())["status"] == "draining"

        # Publishing before the signal is handled would be accepted, rightly: wait for the drain.
        deadline = time.monotonic() + 30
        while not await draining():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        async with http.post(f"/v1/queues/{QUEUE}/messages", json={"data": "late"}) as answer:
            assert answer.status == 503 and (await answer.json())["error"]["code"] == "not_ready"
        async with http.post(f"{SUB}/ack", json={"receipts": [m.receipt for m in held]}) as answer:
            assert answer.status == 200
            assert [r["status"] for r in (await answer.json())["results"]] == ["acked"] * 4

    assert await asyncio.to_thread(sidecar.process.wait, 30) == 0  # drained long before 60 s
    paths = store.paths(REF)
    for shard in range(2):
        offset = catalog.read_offset(store, paths.subscriber(SUBSCRIBER), shard)
        assert offset == catalog.read_int(store, paths.head(shard)) + 1
        assert store.zk.exists(paths.subscriber(SUBSCRIBER).lease(shard)) is None
    assert store.zk.get_children(paths.subscriber(SUBSCRIBER).members) == []
    assert (await queue_stats(store, REF)).published_messages == 4  # the refused late publish is not there


# schemathesis draws some values with `random` inside its strategies; that is its business.
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
async def test_prometheus_scrapes_the_metrics_port_which_serves_nothing_else(
    store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    create_queue(store)
    # On loopback here; in a pod the default 0.0.0.0 lets Prometheus reach the pod's address.
    sidecar = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", SUBSCRIBER, env={
        "CASQUE_SIDECAR_METRICS_PORT": "0", "CASQUE_SIDECAR_METRICS_HOST": "127.0.0.1"})
    async with AsyncClient(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        await client.publish_batch([{"data": i} for i in range(3)])
        received = []
        while len(received) < 3:
            received.extend(await client.receive(max=3, wait=5))
        await client.ack_batch([m.receipt for m in received])
    metrics = sidecar.metrics_url()
    assert metrics != f"{sidecar.url}/metrics"
    async with aiohttp.ClientSession() as http:
        async with http.get(metrics) as answer:
            assert answer.status == 200 and answer.content_type == "text/plain"
            text = await answer.text()
        for line in (f'casque_sidecar_published_messages_total{{queue="{QUEUE}"}} 3.0',
                     f'casque_sidecar_acked_messages_total{{queue="{QUEUE}",subscriber="{SUBSCRIBER}"}} 3.0',
                     f'casque_sidecar_leased_shards{{subscriber="{SUBSCRIBER}"}} 2.0'):
            assert line in text, line
        # Only /metrics: the queue API stays on the loopback port alone.
        base = metrics.removesuffix("/metrics")
        async with http.post(f"{base}/v1/queues/{QUEUE}/messages", json={"data": "x"}) as answer:
            assert answer.status == 404


async def test_the_kubelet_probes_the_health_port_which_serves_nothing_else(
    store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    create_queue(store)
    # On loopback here; in a pod the default 0.0.0.0 lets the kubelet reach the pod's address.
    sidecar = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", SUBSCRIBER, env={
        "CASQUE_SIDECAR_HEALTH_PORT": "0", "CASQUE_SIDECAR_HEALTH_HOST": "127.0.0.1",
        "CASQUE_SIDECAR_TOKEN": "a-token-the-kubelet-does-not-have"})
    health = sidecar.health_url()
    assert health != sidecar.url
    async with aiohttp.ClientSession() as http:
        # The kubelet sends no token and names the pod's address: the probes answer all the same.
        for path, status in (("/healthz", "ok"), ("/readyz", "ok"), ("/readyz?scope=serving", "ok")):
            async with http.get(f"{health}{path}") as answer:
                assert answer.status == 200, (path, await answer.text())
                assert (await answer.json())["status"] == status
        async with http.get(f"{health}/readyz") as answer:
            assert f"member/{SUBSCRIBER}" in (await answer.json())["checks"]  # the API port's full report
        # Only the probes: no queue API, no metrics, no document on this port.
        for path in (f"/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}/stats", "/metrics", "/openapi.json"):
            async with http.get(f"{health}{path}") as answer:
                assert answer.status == 404, path
        async with http.post(f"{health}/v1/queues/{QUEUE}/messages", json={"data": "x"}) as answer:
            assert answer.status == 404
        # While the API port still wants its token.
        async with http.get(f"{sidecar.url}/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}/stats") as answer:
            assert answer.status == 401


# sidecar/openapi.py's LINKS: publish and publishBatch to history and receive; receive to
# history, ack, nack and extend.
DOCUMENT_LINKS = 8


def test_fuzzing_the_api_from_its_openapi_document_finds_nothing_with_every_check(
    store: Store, start_sidecar: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    """schemathesis with every check (what the document allows is served, what it forbids is
    refused, answers and their headers as documented, `Allow` on 405) and every phase: its
    examples, coverage, fuzzing, and stateful sequences along the document's links (publish
    to history and receive, receive to ack, nack and extend) and those it infers. Once with the served queue and subscriber, so requests reach the
    engine, and once with names it makes up."""
    create_queue(store, shards=2, visibility=1)
    sidecar = start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER, "--max-wait", "0.2")
    for i in range(20):  # something for receive, ack and seek to work on
        request = urllib.request.Request(f"{sidecar.url}/v1/queues/{QUEUE}/messages", method="POST",
                                         data=json.dumps({"data": i}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request).close()
    served = tmp_path / "served.toml"
    served.write_text(f'[parameters]\n"path.queue" = "{QUEUE}"\n"path.subscriber" = "{SUBSCRIBER}"\n')
    made_up = tmp_path / "made-up.toml"
    made_up.write_text("")
    for config in (served, made_up):
        run = subprocess.run(
            [str(Path(sys.executable).parent / "st"), "--config-file", str(config), "run", f"{sidecar.url}/openapi.json",
             "--checks", "all", "--max-examples", "40", "--generation-database", "none", "--no-color"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert run.returncode == 0, f"{config.name}:\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}"
        assert " passed" in run.stdout and "failed" not in run.stdout.split("SUMMARY")[-1], run.stdout[-4000:]
        # The stateful phase knew the document's own links, beside those it inferred, and went
        # along links where the queue exists (elsewhere no call answers 200 to follow). Which
        # and how many it covers is drawn at random: 9 to 11 of 11 in three runs.
        links = re.findall(r"(\d+) covered / \d+ selected / (\d+) total(?: \((\d+) inferred\))?", run.stdout)
        assert links, run.stdout[-4000:]
        covered, total, inferred = map(int, (n or 0 for n in links[-1]))
        assert total - inferred == DOCUMENT_LINKS, links[-1]
        assert covered > 0 or config is made_up, links[-1]
    assert sidecar.process.poll() is None  # still serving
    assert "Traceback" not in sidecar.log.read_text()


async def test_sigusr2_reports_memory_and_a_tracing_sidecar_names_the_lines_that_grew(
    store: Store, start_sidecar: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    create_queue(store)
    # Not tracing: a census in the log, and the process serves on (SIGUSR2 would end it by default).
    plain = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", SUBSCRIBER)
    plain.process.send_signal(signal.SIGUSR2)
    await wait_for_log(plain, "memory report 1: RSS")
    async with AsyncClient(plain.url, queue=QUEUE) as client:
        assert (await client.publish({"data": "after the report"})).message_id
    assert plain.alive

    snapshots = tmp_path / "snapshots"
    traced = await asyncio.to_thread(start_sidecar, "--queue", QUEUE, "--subscriber", SUBSCRIBER, env={
        "CASQUE_SIDECAR_MEMORY_TRACE_FRAMES": "4", "CASQUE_SIDECAR_MEMORY_SNAPSHOT_DIR": str(snapshots)})
    async with AsyncClient(traced.url, queue=QUEUE) as client:
        await client.publish_batch([{"id": f"warm-{i}", "data": i} for i in range(50)])
        traced.process.send_signal(signal.SIGUSR2)
        before = await wait_for_snapshot(traced, snapshots, 1)
        # Each identified publish leaves its id in the sidecar's memory of recent ids.
        for start in range(0, 3000, 500):
            await client.publish_batch([{"id": f"grow-{i:06d}", "data": i} for i in range(start, start + 500)])
        traced.process.send_signal(signal.SIGUSR2)
        after = await wait_for_snapshot(traced, snapshots, 2)
        assert (await client.publish({"data": "after the snapshots"})).message_id
    grown = growth(before, after, top=10)
    assert any("casque/engine/idempotency.py" in line.where.replace("\\", "/") and line.size_change_bytes > 0
               for line in grown), grown
    assert traced.alive


async def wait_for_log(sidecar: SidecarProcess, text: str) -> None:
    deadline = time.monotonic() + 60
    while text not in sidecar.tail(20_000):
        assert time.monotonic() < deadline, f"{text!r} never logged: {sidecar.tail()}"
        assert sidecar.alive, f"sidecar exited: {sidecar.tail()}"
        await asyncio.sleep(0.1)


async def wait_for_snapshot(sidecar: SidecarProcess, directory: Path, number: int) -> Path:
    """The sidecar's `number`th snapshot, once written whole (it is renamed into place)."""
    await wait_for_log(sidecar, f"memory report {number}: RSS")
    (path,) = [p for p in directory.glob(f"*-{number:04d}{SNAPSHOT_SUFFIX}")]
    return path
