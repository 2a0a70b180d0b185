"""The Spark jobs on real Spark (local mode) against the test session's Cassandra and ZooKeeper.

One SparkSession serves the whole module (a JVM start costs seconds on two cores). Every
expectation is computed independently with the Python driver from the same rows.

Select them with `-m spark`; they need `scripts/install-spark.sh` to have cached the
connector jars (the session refuses to download anything at test time).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from cassandra.cluster import Session
from typer.testing import CliRunner

from casque.cli.main import app
from casque.config import Settings
from casque.engine import catalog
from casque.engine.acks import ACK, AckEvent, AckLog
from casque.engine.batches import Log
from casque.engine.messages import OutgoingMessage
from casque.errors import BackendUnavailable
from casque.schema import CLIENT_IDS_TABLE, PUBLISH_WRITERS_TABLE, QueueRef, bucket_of
from casque.spark import export, readers, replay, stats
from casque.spark.ranges import parse_range, resolve
from casque.spark.session import SparkOptions, build_session
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import Backends

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SOURCE = QueueRef("default", "history")
TARGET = QueueRef("default", "replayed")
# Two priority levels of two shards: logs 0, 1, 1000, 1001.
SPEC = QueueSpec(shards=2, priorities=2, retention_seconds=3600, consistency="ONE")
# Shard 0 starts at batch 60, as if 1..59 had expired: its batches cross the bucket boundary at 64.
FIRST_BATCH = {0: 60}
MINUTES = 5


@pytest.fixture(scope="module")
def spark(backends: Backends) -> Iterator[Any]:
    settings = Settings(cassandra_contact_points=backends.contact_points, cassandra_port=backends.cql_port,
                        consistency="ONE")
    # Every test makes a keyspace of its own, after the session started. The connector keeps
    # its Cassandra session (and that session's schema metadata) open between jobs; a short
    # keep-alive makes each test's jobs open a fresh one that knows the new keyspace.
    session = build_session(settings, SparkOptions(
        connector="local", app_name="casque-tests", conf={"spark.cassandra.connection.keepAliveMS": "100"}))
    try:
        yield session
    finally:
        session.stop()


@dataclass(frozen=True)
class Stored:
    shard: int
    batch: int
    seq: int
    message_id: str
    published_at: datetime
    message: OutgoingMessage


@dataclass
class History:
    messages: list[Stored]
    start: datetime

    def by_id(self) -> dict[str, Stored]:
        return {m.message_id: m for m in self.messages}


def _payload(rng: random.Random) -> bytes:
    size = rng.choice([0, 1, 40, 200, 900, 3000, 20_000, 70_000])
    return rng.randbytes(size)


# A claim whose answer times out (a node busy past the request timeout) is made again.
CLAIM_ATTEMPTS = 5


async def _claim(log: Log, shard: int, batch: int, items: list[tuple[str, OutgoingMessage]],
                 totals: tuple[int, int], now: datetime) -> None:
    """Claim `batch`, as a publisher settles a claim whose answer timed out on a busy node:
    the same claim again, which finds the batch its own if the first one landed."""
    writer = f"test/{uuid.uuid4().hex[:8]}"
    for attempt in range(1, CLAIM_ATTEMPTS + 1):
        try:
            claim = await log.claim(shard, batch, items, writer, totals, now=now)
            break
        except BackendUnavailable:
            if attempt == CLAIM_ATTEMPTS:
                raise
    assert claim.applied or (claim.header is not None and claim.header.writer == writer), claim


async def _write_history(store: Store, queue: QueueRef, spec: QueueSpec, seed: int) -> History:
    """Batches over MINUTES minutes of publish time, in every log, written as the publisher writes them."""
    rng = random.Random(seed)
    log = Log(store, queue, spec.consistency)
    start = (datetime.now(timezone.utc) - timedelta(minutes=MINUTES + 2)).replace(second=0, microsecond=0)
    stored: list[Stored] = []
    for shard in spec.log_shards():
        batch = FIRST_BATCH.get(shard, 1)
        totals = (0, 0)
        for minute in range(MINUTES):
            for tick in range(rng.randint(2, 4)):
                # Millisecond times, as Cassandra keeps them.
                now = start + timedelta(minutes=minute, seconds=tick * 13 + rng.randint(0, 9),
                                        milliseconds=rng.randint(0, 999))
                items = []
                for _ in range(rng.randint(1, 12)):
                    key = rng.choice([None, None, "alpha", "beta", "ключ"])
                    attributes = rng.choice([{}, {"source": "test"}, {"ü": "ß", "trace": uuid.uuid4().hex}])
                    message = OutgoingMessage(
                        payload=_payload(rng), key=key, attributes=attributes,
                        content_type=rng.choice([None, "application/octet-stream", "text/plain"]),
                        client_id=rng.choice([None, uuid.uuid4().hex]),
                        ttl_seconds=rng.choice([None, None, None, 3000]),
                    )
                    items.append((str(uuid.uuid4()), message))
                await _claim(log, shard, batch, items, totals, now)
                totals = (totals[0] + len(items), totals[1] + sum(m.size for _, m in items))
                for seq, (message_id, message) in enumerate(items):
                    stored.append(Stored(shard, batch, seq, message_id, now, message))
                batch += 1
        store.zk.set(store.paths(queue).head(shard), str(batch - 1).encode())
    return History(stored, start)


@pytest.fixture
def history(store: Store) -> History:
    catalog.apply_queue(store, SOURCE, SPEC)
    return asyncio.run(_write_history(store, SOURCE, SPEC, seed=7))


def _driver_rows(cql: Session, store: Store, queue: QueueRef) -> list[Any]:
    return list(cql.execute(f"SELECT * FROM {store.table(queue)}"))


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment


def _size(row: Any) -> int:
    return (len(row.payload or b"") + len((row.key or "").encode())
            + sum(len(k.encode()) + len(v.encode()) for k, v in (row.attributes or {}).items()))


def _plan(frame: Any) -> str:
    return str(frame._jdf.queryExecution().executedPlan().toString())


# --- ranges and pushdown -------------------------------------------------------------------------
def test_ranges_resolve_to_the_buckets_of_the_batches_asked(store: Store, history: History) -> None:
    heads = {s: max(m.batch for m in history.messages if m.shard == s) for s in SPEC.log_shards()}
    everything = resolve(store, SOURCE, parse_range(None))
    # The expired prefix of shard 0 is skipped: its reads start at batch 60, in bucket 0.
    assert {s.shard: s.intervals for s in everything.shards} == {
        s: ((FIRST_BATCH.get(s, 1), heads[s]),) for s in SPEC.log_shards()
    }
    assert everything.shards[0].buckets == (0, 1)

    some = resolve(store, SOURCE, parse_range("0:64-66,1:2-3,1:5-5"))
    assert {s.shard: s.intervals for s in some.shards} == {0: ((64, 66),), 1: ((2, 3), (5, 5)), 1000: (), 1001: ()}
    assert some.shards[0].buckets == (1,) and some.partitions == 2

    # A time window becomes batch bounds by binary search over the headers.
    since = history.start + timedelta(minutes=1)
    until = history.start + timedelta(minutes=3)
    window = resolve(store, SOURCE, parse_range(None).with_times(since, until))
    for shard in window.shards:
        inside = sorted({m.batch for m in history.messages
                         if m.shard == shard.shard and since <= m.published_at < until})
        assert shard.intervals == ((inside[0], inside[-1]),)


def test_reads_push_shard_and_bucket_down_to_cassandra(spark: Any, store: Store, history: History) -> None:
    resolved = resolve(store, SOURCE, parse_range("0:64-66,1001:1-"))
    frame = readers.messages(spark, store.keyspace, resolved)
    plan = _plan(frame)
    scans = [line for line in plan.splitlines() if "Cassandra Scan" in line or "Cassandra Filters" in line]
    assert scans, plan
    # One pushed-down read per bucket list: shard 0 reads bucket 1 only, shard 1001 bucket 0 only.
    assert '["shard" IN (?), (0)]' in plan or '["shard" = ?, 0]' in plan, plan
    assert '["bucket" IN (?), (1)]' in plan or '["bucket" = ?, 1]' in plan, plan
    assert "1001" in plan
    filters = [line for line in plan.splitlines() if "Cassandra Filters" in line]
    assert len(filters) == 2 and all('"shard"' in f and '"bucket"' in f for f in filters), plan
    got = sorted((r.shard, r.batch_no, r.seq) for r in frame.select("shard", "batch_no", "seq").collect())
    want = sorted((m.shard, m.batch, m.seq) for m in history.messages
                  if (m.shard == 0 and 64 <= m.batch <= 66) or m.shard == 1001)
    assert got == want


# --- stats ---------------------------------------------------------------------------------------
def _expected_stats(rows: list[Any], since: datetime | None = None, until: datetime | None = None) -> dict[str, Any]:
    per_minute: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    per_shard: Counter[int] = Counter()
    bins: Counter[int] = Counter()
    total_bytes = 0
    count = 0
    for row in rows:
        published = _utc(row.published_at)
        if row.seq < 0 or (since and published < since) or (until and published >= until):
            continue
        size = _size(row)
        minute = published.replace(second=0, microsecond=0).isoformat().replace("+00:00", "Z")
        per_minute[minute][0] += 1
        per_minute[minute][1] += size
        per_shard[row.shard] += 1
        bins[next((i for i, upper in enumerate(stats.SIZE_BINS) if size <= upper), len(stats.SIZE_BINS))] += 1
        total_bytes += size
        count += 1
    return {"per_minute": {k: tuple(v) for k, v in per_minute.items()}, "per_shard": dict(per_shard),
            "bins": dict(bins), "bytes": total_bytes, "messages": count}


def _ack_some(store: Store, history: History) -> dict[str, int]:
    """Ack rows for some messages (as consumers write them for incomplete batches)."""
    for name in ("billing", "audit"):
        catalog.apply_subscriber(store, SOURCE, name, SubscriberSpec(queue=SOURCE.name, start_position="earliest"))

    async def write() -> dict[str, int]:
        counts = {}
        for name, share in (("billing", 3), ("audit", 5)):
            key = catalog.read_subscriber(store, SOURCE, name).ack_key(name)
            acks = AckLog(store, SOURCE, key, SPEC.retention_seconds)
            chosen = [m for i, m in enumerate(history.messages) if i % share == 0]
            await asyncio.gather(*(acks.record(AckEvent(0, m.shard, m.batch, m.seq, outcome=ACK)) for m in chosen))
            await acks.flush()
            counts[name] = len(chosen)
        return counts

    return asyncio.run(write())


def test_stats_match_counts_computed_with_the_driver(
    spark: Any, store: Store, cql: Session, history: History, tmp_path: Path
) -> None:
    acked = _ack_some(store, history)
    # billing has consumed shard 1 up to batch 4: its lag there is what lies from batch 4 on.
    store.zk.set(store.paths(SOURCE).subscriber("billing").offset(1), b"4")
    rows = _driver_rows(cql, store, SOURCE)
    want = _expected_stats(rows)

    result = stats.compute(spark, store, resolve(store, SOURCE, parse_range(None)), tmp_path / "all")
    summary = result.summary
    assert summary["messages"] == want["messages"] == len(history.messages)
    assert summary["bytes"] == want["bytes"]
    assert summary["batches"] == sum(1 for r in rows if r.seq < 0)
    minutes = {r["minute"]: (r["messages"], r["bytes"]) for r in result.tables["per_minute"]}
    assert minutes == want["per_minute"] and len(minutes) == MINUTES
    assert {r["shard"]: r["messages"] for r in result.tables["shards"]} == want["per_shard"]
    assert {r["bin"]: r["messages"] for r in result.tables["sizes"] if r["messages"]} == want["bins"]
    sizes = sorted(_size(r) for r in rows if r.seq >= 0)
    assert summary["size"]["min"] == sizes[0] and summary["size"]["max"] == sizes[-1]

    # Latency: every recorded ack counts once; ack time minus publish time, from the timeuuid.
    latency = {r["subscriber"]: r for r in result.tables["latency"]}
    assert {name: r["acked"] for name, r in latency.items()} == acked
    ack_rows = list(cql.execute(f"SELECT subscriber, batch_no, shard, entry, seqs FROM {store.keyspace}.acks"))
    published = {(m.shard, m.batch, m.seq): m.published_at for m in history.messages}
    billing_key = catalog.read_subscriber(store, SOURCE, "billing").ack_key("billing")
    delays = [
        (datetime(1582, 10, 15, tzinfo=timezone.utc) + timedelta(microseconds=r.entry.time // 10)
         - published[(r.shard, r.batch_no, seq)]).total_seconds() * 1000
        for r in ack_rows if r.subscriber == billing_key for seq in r.seqs
    ]
    assert latency["billing"]["min_ms"] == pytest.approx(min(delays), abs=1)
    assert latency["billing"]["max_ms"] == pytest.approx(max(delays), abs=1)

    # Lag from the offsets and the headers' running totals.
    lag = {(r["subscriber"], r["shard"]): r for r in result.tables["lag"]}
    from_batch_4 = sum(1 for m in history.messages if m.shard == 1 and m.batch >= 4)
    assert lag[("billing", 1)]["lag_messages"] == from_batch_4
    assert lag[("audit", 1)]["lag_messages"] == sum(1 for m in history.messages if m.shard == 1)

    out = tmp_path / "all"
    for name in ("per_minute", "sizes", "shards", "latency", "lag"):
        assert (out / f"{name}.json").exists()
        written = json.loads((out / f"{name}.json").read_text())
        assert spark.read.parquet(str(out / "parquet" / name)).count() == len(written)
    assert (out / "report.html").exists() and (out / "summary.md").exists()
    charts = {p.name for p in (out / "charts").glob("*.png")}
    assert charts == {"per_minute.png", "sizes.png", "shards.png", "latency.png", "lag.png"}
    assert all((out / "charts" / c).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for c in charts)

    # A time window and a batch range.
    since = history.start + timedelta(minutes=1, seconds=20)
    until = history.start + timedelta(minutes=3, seconds=30)
    windowed = stats.compute(spark, store, resolve(store, SOURCE, parse_range(None).with_times(since, until)),
                             tmp_path / "window")
    want_window = _expected_stats(rows, since, until)
    assert windowed.summary["messages"] == want_window["messages"]
    window_minutes = {r["minute"]: (r["messages"], r["bytes"]) for r in windowed.tables["per_minute"]}
    assert window_minutes == want_window["per_minute"]

    ranged = readers.messages(spark, store.keyspace, resolve(store, SOURCE, parse_range("0:62-70")))
    assert ranged.count() == sum(1 for m in history.messages if m.shard == 0 and 62 <= m.batch <= 70)


# --- export --------------------------------------------------------------------------------------
def _check_message(stored: Stored, got: dict[str, Any], payload: bytes) -> None:
    message = stored.message
    assert payload == message.payload
    assert (got["shard"], got["batch"], got["seq"]) == (stored.shard, stored.batch, stored.seq)
    assert got["key"] == message.key
    assert (got["attributes"] or {}) == dict(message.attributes)
    assert got["content_type"] == message.content_type
    assert got["client_id"] == message.client_id
    assert (got["expires_at"] is None) == (message.ttl_seconds is None)


def test_export_round_trips_every_message_byte_for_byte(
    spark: Any, store: Store, history: History, tmp_path: Path
) -> None:
    resolved = resolve(store, SOURCE, parse_range(None))
    expected = history.by_id()

    jsonl = export.export(spark, store.keyspace, resolved, "jsonl", tmp_path / "jsonl")
    assert jsonl.messages == len(expected)
    seen: list[tuple[int, int, int]] = []
    for part in sorted((tmp_path / "jsonl" / "messages").glob("part-*.json")):
        for line in part.read_text(encoding="utf-8").splitlines():
            got = json.loads(line)
            stored = expected[got["message_id"]]
            _check_message(stored, got, base64.b64decode(got["payload_base64"], validate=True))
            published = datetime.fromisoformat(got["published_at"].replace("Z", "+00:00"))
            assert published == stored.published_at
            seen.append((got["shard"], got["batch"], got["seq"]))
    assert seen == sorted(seen) and len(seen) == len(set(seen)) == len(expected)  # in log order, each once
    manifest = json.loads((tmp_path / "jsonl" / "manifest.json").read_text())
    assert manifest["messages"] == len(expected)
    assert manifest["payload_bytes"] == sum(len(m.message.payload) for m in history.messages)

    parquet = export.export(spark, store.keyspace, resolved, "parquet", tmp_path / "parquet")
    assert parquet.messages == len(expected)
    rows = spark.read.parquet(str(tmp_path / "parquet" / "messages")).collect()
    assert len(rows) == len(expected)
    for row in rows:
        got = row.asDict()
        stored = expected[got["message_id"]]
        _check_message(stored, got, bytes(got["payload"]))
        assert _utc(got["published_at"]) == stored.published_at

    # A time window exports exactly the messages published in it.
    since = history.start + timedelta(minutes=2)
    windowed = export.export(spark, store.keyspace, resolve(store, SOURCE, parse_range(None).with_times(since, None)),
                             "parquet", tmp_path / "since")
    assert windowed.messages == sum(1 for m in history.messages if m.published_at >= since)


# --- replay --------------------------------------------------------------------------------------
def _target_messages(cql: Session, store: Store) -> list[Any]:
    rows = [r for r in cql.execute(f"SELECT * FROM {store.table(TARGET)}") if r.seq >= 0]
    return sorted(rows, key=lambda r: (r.shard, r.batch_no, r.seq))


def test_replay_delivers_the_range_exactly_once_and_a_rerun_adds_nothing(
    spark: Any, store: Store, cql: Session, history: History
) -> None:
    catalog.apply_queue(store, TARGET, QueueSpec(shards=3, retention_seconds=3600, consistency="ONE"))
    since = history.start + timedelta(minutes=1)
    resolved = resolve(store, SOURCE, parse_range("*:1-").with_times(since, None))
    selected = [m for m in history.messages if m.published_at >= since]

    first = asyncio.run(replay.replay(spark, store, resolved, TARGET))
    assert first.selected == len(selected)
    assert first.published + first.expired == len(selected) and first.expired == 0
    rows = _target_messages(cql, store)
    by_client = {r.client_id: r for r in rows}
    assert len(rows) == len(by_client) == len(selected)  # each exactly once
    for m in selected:
        row = by_client[replay.client_id(SOURCE, m.shard, m.batch, m.seq)]
        assert (row.payload or b"") == m.message.payload and row.key == m.message.key
        assert dict(row.attributes or {}) == dict(m.message.attributes)
        assert row.content_type == m.message.content_type
        # Priority 1 stays priority 1 (the target has one level only: its highest, 0).
        assert row.shard < 1000
    # Per key, the target holds the messages in the source's order.
    for key in ("alpha", "beta", "ключ"):
        for level in (0, 1):
            source_order = [replay.client_id(SOURCE, m.shard, m.batch, m.seq)
                            for m in sorted(selected, key=lambda m: (m.shard, m.batch, m.seq))
                            if m.message.key == key and m.shard // 1000 == level]
            target_order = [r.client_id for r in rows if r.key == key and r.client_id in set(source_order)]
            assert target_order == source_order

    # A rerun finds everything there already.
    second = asyncio.run(replay.replay(spark, store, resolved, TARGET))
    assert second.published == 0 and second.already_there == len(selected)
    assert len(_target_messages(cql, store)) == len(selected)

    # Even once the publish ids have expired (here: removed), the target's own rows tell.
    for table in (CLIENT_IDS_TABLE, PUBLISH_WRITERS_TABLE):
        cql.execute(f"TRUNCATE {store.keyspace}.{table}")
    widened = resolve(store, SOURCE, parse_range(None))
    third = asyncio.run(replay.replay(spark, store, widened, TARGET))
    assert third.already_there == len(selected)
    assert third.published == len(history.messages) - len(selected)
    assert len(_target_messages(cql, store)) == len(history.messages)


# --- the CLI -------------------------------------------------------------------------------------
@pytest.fixture
def env(store: Store, backends: Backends, keyspace: str, zk_hosts: str) -> dict[str, str]:
    return backends.client_env(keyspace, zk_hosts, store.zk_root)


def test_cli_commands(spark: Any, store: Store, history: History, env: dict[str, str], tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    working = tmp_path / "working"  # where a job without --out writes
    working.mkdir()
    monkeypatch.chdir(working)

    def run(*args: str, code: int = 0) -> Any:
        result = runner.invoke(app, ["spark", *args], env=env)
        assert result.exit_code == code, (result.output, result.exception)
        return result

    start = history.start.isoformat().replace("+00:00", "Z")
    until = (history.start + timedelta(minutes=2)).isoformat().replace("+00:00", "Z")
    done = run("stats", "--queue", SOURCE.name, "--since", start, "--until", until, "--out", str(tmp_path / "s"))
    assert "report:" in done.output and (tmp_path / "s" / "report.html").exists()
    assert f"stats of {SOURCE} (Spark tasks)" in done.stderr  # the progress bar, beside the output
    in_window = sum(1 for m in history.messages if m.published_at < history.start + timedelta(minutes=2))
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["messages"] == in_window

    exported = run("export", "--queue", SOURCE.name, "--from", start, "--to", until, "--format", "jsonl",
                   "--out", str(tmp_path / "e"))
    assert f"export of {SOURCE} (Spark tasks)" in exported.stderr
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["messages"] == in_window
    # The output directory is never overwritten silently.
    refused = run("export", "--queue", SOURCE.name, "--format", "jsonl", "--out", str(tmp_path / "e"), code=1)
    assert "not empty" in refused.stderr
    # With --overwrite a job that succeeds replaces the earlier results whole: no file of theirs is left.
    replaced = {f"messages/{p.name}" for p in (tmp_path / "e" / "messages").glob("part-*")}
    run("export", "--queue", SOURCE.name, "--from", start, "--to", until, "--format", "jsonl", "--overwrite",
        "--out", str(tmp_path / "e"))
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert manifest["messages"] == in_window
    assert sorted(f"messages/{p.name}" for p in (tmp_path / "e" / "messages").glob("part-*")) == manifest["files"]
    assert not set(manifest["files"]) & replaced

    catalog.apply_queue(store, TARGET, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    replayed = run("replay", "--queue", SOURCE.name, "--range", "1:1-3", "--into", TARGET.name)
    assert f"{sum(1 for m in history.messages if m.shard == 1 and m.batch <= 3):,} published" in replayed.output

    # Refusals are one line on stderr with the exit code of casque/cli/exits.py.
    for args, words, code in (
        (("stats", "--queue", SOURCE.name, "--range", "0:9-2"), "first batch is after the last", 1),
        (("stats", "--queue", SOURCE.name, "--since", "yesterday"), "not an RFC3339 time", 1),
        (("export", "--queue", SOURCE.name, "--range", "7:1-", "--out", str(tmp_path / "x")), "no shard 7", 1),
        (("export", "--queue", SOURCE.name, "--format", "csv", "--out", str(tmp_path / "x")), "parquet, jsonl", 1),
        (("replay", "--queue", SOURCE.name, "--into", "missing"), "does not exist", 3),
        (("replay", "--queue", SOURCE.name, "--into", SOURCE.name), "into itself", 1),
    ):
        refused = run(*args, code=code)
        lines = [line for line in refused.stderr.splitlines() if line.startswith("casque: ")]
        assert len(lines) == 1 and words in lines[0], (args, refused.stderr)

    # A batch written in a later format (casque.formats: its header's writer marked) stops
    # every job that reads it, in one line, rather than being read as this release's.
    first = min((m for m in history.messages if m.shard == 0), key=lambda m: m.batch)
    header = (bucket_of(first.batch), first.batch)
    (writer,) = store.session.execute(
        f"SELECT writer FROM {store.keyspace}.{SOURCE.messages_table} WHERE shard = 0 AND bucket = %s "
        "AND batch_no = %s AND seq = -1", header).one()
    store.session.execute(
        f"UPDATE {store.keyspace}.{SOURCE.messages_table} SET writer = %s WHERE shard = 0 AND bucket = %s "
        "AND batch_no = %s AND seq = -1", (f"{writer}#2", *header))
    later = f"casque: batch {first.batch} of shard 0 was written in format 2; this version of casque reads up to 1"
    for args in (("stats", "--queue", SOURCE.name, "--range", f"0:{first.batch}-"),
                 ("export", "--queue", SOURCE.name, "--range", f"0:{first.batch}-", "--out", str(tmp_path / "later"))):
        refused = run(*args, code=1)
        lines = [line for line in refused.stderr.splitlines() if line.startswith("casque: ")]
        assert lines == [f"{later}: upgrade it"], (args, refused.stderr)
    # A refused job leaves no directory it made (an empty one would read as a result), and
    # one refused with --overwrite leaves the earlier results it would have replaced.
    def contents(directory: Path) -> dict[Path, bytes]:
        return {path.relative_to(directory): path.read_bytes() for path in directory.rglob("*") if path.is_file()}
    earlier = contents(tmp_path / "e")
    refused = run("export", "--queue", SOURCE.name, "--range", f"0:{first.batch}-", "--format", "jsonl", "--overwrite",
                  "--out", str(tmp_path / "e"), code=1)
    assert [line for line in refused.stderr.splitlines() if line.startswith("casque: ")] == [f"{later}: upgrade it"]
    assert contents(tmp_path / "e") == earlier
    assert list(working.iterdir()) == [] and not (tmp_path / "later").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["e", "s", "working"]
