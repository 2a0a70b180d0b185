"""`casque publish`, `consume`, `tail`, `stats` (and `--watch`), `seek`, `redrive` on the real stack."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from casque.cli.main import app
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.engine.stats import subscriber_stats
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for

QUEUE = "cli"
REF = QueueRef("default", QUEUE)

Run = Callable[..., Result]


@pytest.fixture
def env(store: Store, backends: Backends, keyspace: str, zk_hosts: str) -> dict[str, str]:
    catalog.apply_queue(store, REF, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    for name in ("reader", "other"):
        catalog.apply_subscriber(store, REF, name, SubscriberSpec(queue=QUEUE, start_position="earliest"))
    return backends.client_env(keyspace, zk_hosts, store.zk_root)


@pytest.fixture
def run(env: dict[str, str]) -> Run:
    def invoke(*args: str, code: int = 0) -> Result:
        result = CliRunner().invoke(app, list(args), env=env)
        assert result.exit_code == code, (result.output, result.stderr, result.exception)
        return result

    return invoke


async def publish_text(store: Store, text: str) -> None:
    state = catalog.read_queue(store, REF)
    publisher = Publisher(store, REF, state)
    await publisher.publish([OutgoingMessage(text.encode(), content_type="text/plain")])
    await publisher.flush_heads()


def lag(store: Store, subscriber: str) -> int | None:
    return asyncio.run(subscriber_stats(store, REF, subscriber)).lag_messages


def test_publish_then_consume_prints_and_acks(run: Run, store: Store) -> None:
    first = run("publish", QUEUE, '{"order": 1}', "--key", "k1", "--attr", "src=cli")
    assert "shard" in first.stdout and "batch" in first.stdout
    run("publish", QUEUE, "plain words")
    run("publish", QUEUE, "again", "--id", "once")
    assert "(duplicate)" in run("publish", QUEUE, "again", "--id", "once").stdout
    consumed = run("consume", QUEUE, "reader", "--max", "3")
    lines = consumed.stdout.splitlines()
    assert len(lines) == 3 and any('{"order":1}' in line and "key=k1" in line for line in lines)
    assert any(line.endswith("plain words") for line in lines)
    assert "3 messages acked" in consumed.stderr
    assert lag(store, "reader") == 0
    assert lag(store, "other") == 3  # another subscriber still has them all


def test_publish_many_from_a_file_and_consume_as_json(run: Run, store: Store, tmp_path: Path) -> None:
    lines = [json.dumps({"data": {"n": i}, "partitionkey": f"k{i % 7}"}) for i in range(250)]
    source = tmp_path / "messages.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert "published 250 messages" in run("publish", QUEUE, "--file", str(source)).stdout
    run("publish", QUEUE, "tick", "--count", "250")
    consumed = run("consume", QUEUE, "reader", "--max", "500", "--output", "json")
    events = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert len(events) == 500 and all(e["specversion"] == "1.0" for e in events)
    assert sorted(e["data"]["n"] for e in events if isinstance(e.get("data"), dict)) == list(range(250))
    assert lag(store, "reader") == 0

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"data": 1}\n{"data": 1, "dealy": 5}\n')
    refused = run("publish", QUEUE, "--file", str(bad), code=2)
    assert "bad.jsonl:2" in refused.stderr


def test_tail_reads_without_consuming(run: Run, store: Store, env: dict[str, str]) -> None:
    run("publish", QUEUE, "--count", "3", "old")
    back = run("tail", QUEUE, "--last", "5", "--no-follow")
    assert [line.rsplit(" ", 1)[-1] for line in back.stdout.splitlines()] == ["old"] * 3
    assert lag(store, "reader") == 3  # nobody consumed anything

    # Following: the tail wakes on the head watch when new batches land.
    results: list[Result] = []
    follower = threading.Thread(
        target=lambda: results.append(CliRunner().invoke(app, ["tail", QUEUE, "--max", "3", "-o", "json"], env=env))
    )
    follower.start()
    deadline = time.monotonic() + 60
    while follower.is_alive():
        assert time.monotonic() < deadline, "tail never printed three new messages"
        # Not through the CLI: a second CliRunner would swap the stdout the tail prints to.
        asyncio.run(publish_text(store, "new"))
        follower.join(0.2)
    (result,) = results
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["data"] for line in result.stdout.splitlines()] == ["new"] * 3


def test_stats_as_a_table_and_as_json(run: Run) -> None:
    run("publish", QUEUE, "--count", "5", "x")
    table = run("stats", QUEUE).stdout
    assert "queue default/cli" in table and "reader" in table and "other" in table
    document = json.loads(run("stats", QUEUE, "--output", "json", "--subscriber", "reader").stdout)
    assert document["queue"]["publishedMessages"] == 5
    assert [s["subscriber"] for s in document["subscribers"]] == ["reader"]
    assert document["subscribers"][0]["lagMessages"] == 5


def test_seek_moves_a_subscriber(run: Run, store: Store) -> None:
    run("publish", QUEUE, "--count", "4", "replay me")
    run("consume", QUEUE, "reader", "--max", "4")
    assert lag(store, "reader") == 0
    moved = run("seek", QUEUE, "reader", "--to", "earliest")
    assert "moved (earliest)" in moved.stdout
    assert lag(store, "reader") == 4
    run("seek", QUEUE, "reader", "--to", "latest")
    assert lag(store, "reader") == 0
    run("seek", QUEUE, "reader", "--batch", "0=1", "--batch", "1=1")
    assert lag(store, "reader") == 4
    run("seek", QUEUE, "reader", "--time", "2999-01-01T00:00:00")
    assert lag(store, "reader") == 0
    for args in (["--to", "middle"], [], ["--to", "latest", "--batch", "0=1"], ["--batch", "zero=1"]):
        run("seek", QUEUE, "reader", *args, code=2)  # the command line is wrong
    run("seek", QUEUE, "reader", "--batch", "9=1", code=1)  # refused: the queue has no shard 9


def test_errors_are_one_readable_line_and_a_nonzero_exit(env: dict[str, str]) -> None:
    cases = [
        (["publish", "nope", "x"], "casque: queue default/nope does not exist", 3),
        (["consume", QUEUE, "nobody", "--max", "1"], "casque: subscriber nobody of queue default/cli does not exist", 3),
        (["seek", QUEUE, "reader"], "casque: give exactly one of --to, --time or --batch", 2),
        (["publish", QUEUE, "x", "--attr", "novalue"], "casque: --attr 'novalue': expected NAME=VALUE", 2),
    ]
    for args, line, code in cases:
        done = subprocess.run([sys.executable, "-m", "casque.cli", *args], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == code, done.stderr
        assert done.stderr.strip() == line


async def dead_letter_next(store: Store, subscriber: str, reason: str) -> bytes:
    """Receive the subscriber's next message and give up on it: it goes to the dead-letter queue."""
    consumer = Consumer(store, REF, subscriber)
    await consumer.start()
    try:
        (delivery,) = await consumer.receive(max_messages=1, wait=15)
        await consumer.dead_letter(delivery.receipt, reason)
        return delivery.message.payload
    finally:
        await consumer.stop()


def test_redrive_sends_dead_letters_back_to_the_subscriber_that_failed_them_once(run: Run, store: Store) -> None:
    dead = QueueRef("default", "cli-dead")
    catalog.apply_queue(store, dead, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, "reader", SubscriberSpec(
        queue=QUEUE, start_position="earliest", dead_letter_queue=dead.name))
    run("publish", QUEUE, "poison")
    assert asyncio.run(dead_letter_next(store, "reader", "cannot parse")) == b"poison"
    assert lag(store, "reader") == 0

    first = run("redrive", dead.name)
    assert "redrove 1 message(s) to default/cli\n" in first.stdout
    assert "1 redriven, 0 already redriven before" in first.stdout
    assert run("redrive", dead.name).stdout.splitlines()[-1].startswith("0 redriven")  # a rerun sends nothing twice
    assert lag(store, "reader") == 1
    back = run("consume", QUEUE, "reader", "--max", "1")
    assert back.stdout.rstrip().endswith("poison")
    # The subscriber that never failed it does not get it twice.
    other = run("consume", QUEUE, "other", "--idle", "2")
    assert [line.rsplit(" ", 1)[-1] for line in other.stdout.splitlines()] == ["poison"]


def test_redrive_skips_forged_sources_and_says_so_in_one_line(run: Run, store: Store) -> None:
    dead = QueueRef("default", "cli-dead")
    catalog.apply_queue(store, dead, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))

    async def forge() -> None:
        publisher = Publisher(store, dead, catalog.read_queue(store, dead))
        for i, source in enumerate(["other/cli", "other/cli", "Not\nA Queue"]):
            await publisher.publish([OutgoingMessage(b"forged", attributes={
                "casque-dlq-source": source, "casque-dlq-message-id": f"f-{i}"})])
        await publisher.flush_heads()

    asyncio.run(forge())
    result = run("redrive", dead.name)
    assert result.stdout.splitlines() == [
        "skipped 3 dead letter(s) whose source is not a queue of namespace default: "
        "'Not\\nA Queue' (1), 'other/cli' (2)",
        "0 redriven, 0 already redriven before",
    ]


def test_trace_follows_a_message_to_its_dead_letter_and_refuses_unknown_ids(
    run: Run, store: Store, env: dict[str, str]
) -> None:
    dead = QueueRef("default", "cli-dead")
    catalog.apply_queue(store, dead, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, REF, "reader", SubscriberSpec(
        queue=QUEUE, start_position="earliest", dead_letter_queue=dead.name))
    (published,) = json.loads(run("publish", QUEUE, "poison", "--id", "p-1", "--output", "json").stdout)["results"]
    message_id = published["messageId"]
    assert asyncio.run(dead_letter_next(store, "reader", "cannot parse")) == b"poison"

    document = json.loads(run("trace", QUEUE, message_id, "--output", "json").stdout)
    assert (document["place"]["batch"], document["place"]["seq"]) == (published["batch"], published["seq"])
    assert document["eventId"] == "p-1"
    states = {s["subscriber"]: s for s in document["subscribers"]}
    assert (states["reader"]["state"], states["other"]["state"]) == ("dead_lettered", "pending")
    copy_id = states["reader"]["deadLetterMessageId"]
    copy = json.loads(run("trace", dead.name, copy_id, "--output", "json").stdout)
    assert copy["state"] == "logged" and copy["origin"]["kind"] == "dead_letter"
    assert (copy["origin"]["messageId"], copy["origin"]["subscriber"]) == (message_id, "reader")
    assert f"dead letter of message {message_id}" in run("trace", dead.name, copy_id).stdout
    table = run("trace", QUEUE, message_id).stdout  # at its own width, whatever the terminal's
    assert f"batch {published['batch']}, seq {published['seq']}" in table
    assert "dead_lettered" in table and f"cli-dead/{copy_id}" in table

    unknown = message_id[:24] + ("0" * 12 if not message_id.endswith("0" * 12) else "1" * 12)
    done = subprocess.run([sys.executable, "-m", "casque.cli", "trace", QUEUE, unknown], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stderr.startswith(f"casque: message {unknown} is not in queue default/cli")
    assert done.stderr.count("\n") == 1


def test_stats_watch_refreshes_until_interrupted(store: Store, env: dict[str, str]) -> None:
    watch = subprocess.Popen(
        [sys.executable, "-m", "casque.cli", "stats", QUEUE, "--watch", "--interval", "0.2"],
        env={**os.environ, **env, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "NO_COLOR": "1", "COLUMNS": "200"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    shown = bytearray()

    def read() -> None:
        assert watch.stdout is not None
        while chunk := watch.stdout.read1(4096):
            shown.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        def screens() -> list[str]:
            text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", bytes(shown).decode(errors="replace"))  # no styles
            return [s for s in text.split("queue default/cli")[1:] if "members" in s]

        def row(screen: str) -> list[str]:  # shards, batches, messages, bytes, delayed, msgs/s
            return next(line for line in screen.splitlines() if line.strip(" │┃|").split()[:1] == ["2"]).split("│")

        wait_for("the first screen", lambda: screens() and watch.poll() is None)
        asyncio.run(publish_text(store, "seen by the watch"))
        wait_for("a screen showing the new message", lambda: any(
            [c.strip() for c in row(s) if c.strip()][2] == "1" for s in screens()))
    finally:
        watch.send_signal(signal.SIGINT)
        code = watch.wait(60)
        reader.join(10)
    assert code == 0, bytes(shown).decode(errors="replace")[-2000:]


def test_publish_checks_the_queues_schema_and_consume_shows_the_version(run: Run, store: Store) -> None:
    catalog.apply_queue(store, REF, QueueSpec.model_validate({
        "shards": 2, "retention": 3600, "consistency": "ONE", "schemaCompatibility": "none",
        "schema": {"type": "object", "required": ["order"]},
    }))
    run("publish", QUEUE, '{"order": 1}')
    refused = run("publish", QUEUE, '{"other": 1}', code=1)
    assert refused.stderr.strip() == (
        "casque: data at / breaks 'required': must contain ['order'] properties (schema version 1)")
    consumed = run("consume", QUEUE, "reader", "--max", "5", "--output", "json")
    (event,) = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert event["data"] == {"order": 1} and event["schemaversion"] == 1
