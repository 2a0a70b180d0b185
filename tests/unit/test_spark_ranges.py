"""The Spark jobs' pure parts: range syntax, read planning, the timeuuid clock, replay waves.

No backends and no Spark session: these run in milliseconds (marked `spark`, so that
`-m spark` selects everything about the jobs).
"""

from __future__ import annotations

import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from casque.config import CassandraTlsSettings, Settings
from casque.devstack.pki import issue_cert, make_ca
from casque.engine.messages import OutgoingMessage
from casque.instants import FIRST_INSTANT, LAST_INSTANT
from casque.schema import QueueRef
from casque.spark.errors import InvalidRange
from casque.spark.ranges import (
    BatchTerm,
    RangeSpec,
    ResolvedRange,
    ShardRange,
    merge_intervals,
    parse_range,
    parse_time,
    shard_terms,
)
from casque.spark.readers import plan_reads
from casque.spark.replay import client_id, waves
from casque.spark.session import SparkOptions, on_this_machine, spark_conf

pytestmark = pytest.mark.spark

Q = QueueRef("default", "q")


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-11-22T10:00:00Z", datetime(2026, 11, 22, 10, tzinfo=timezone.utc)),
    ("2026-11-22t10:00:00.5z", datetime(2026, 11, 22, 10, 0, 0, 500000, tzinfo=timezone.utc)),
    ("2026-11-22T11:00:00.123456789+01:00", datetime(2026, 11, 22, 10, 0, 0, 123456, tzinfo=timezone.utc)),
    # Before year 1 and after 9999 in UTC: the first and last instants stand for them.
    ("0001-01-01T00:30:00+05:30", FIRST_INSTANT),
    ("9999-12-31T23:59:59-05:00", LAST_INSTANT),
])
def test_rfc3339_times(text: str, expected: datetime) -> None:
    assert parse_time(text) == expected


@pytest.mark.parametrize("text", ["2026-11-22", "2026-11-22T10:00:00", "yesterday", "2026-13-01T00:00:00Z"])
def test_times_without_offset_or_invalid_are_refused(text: str) -> None:
    with pytest.raises(InvalidRange):
        parse_time(text)


def test_range_syntax() -> None:
    assert parse_range(None) == parse_range("") == parse_range("all") == RangeSpec()
    spec = parse_range("0:1-500, 1:1-480")
    assert spec.batches == (BatchTerm(0, 1, 500), BatchTerm(1, 1, 480)) and spec.since is None
    spec = parse_range("*:100-,2026-11-22T10:00:00Z..")
    assert spec.batches == (BatchTerm(None, 100, None),)
    assert spec.since == datetime(2026, 11, 22, 10, tzinfo=timezone.utc) and spec.until is None
    assert str(spec) == "*:100-,2026-11-22T10:00:00Z.."
    window = parse_range("..2026-11-22T10:00:00Z")
    assert window.since is None and window.until is not None
    since = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert parse_range("0:-9").with_times(since, None) == RangeSpec(since, None, (BatchTerm(0, None, 9),))


@pytest.mark.parametrize(("text", "words"), [
    ("0:5-2", "after the last"),
    ("0:0-3", "numbered from 1"),
    ("x", "expected TIME..TIME or SHARD:FIRST-LAST"),
    ("0:1-2,,1:1-2", "empty term"),
    ("2026-11-22T10:00:00Z..2026-11-22T09:00:00Z", "window is empty"),
    ("..2026-11-22T10:00:00Z,2026-11-22T09:00:00Z..", "more than one time window"),
])
def test_bad_ranges_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(InvalidRange, match=words):
        parse_range(text)


def test_time_window_given_twice_is_refused() -> None:
    with pytest.raises(InvalidRange, match="once"):
        parse_range("2026-11-22T10:00:00Z..").with_times(datetime.now(timezone.utc), None)


def test_batch_terms_per_shard() -> None:
    spec = parse_range("0:5-9,0:8-20,*:100-,1:-3")
    assert merge_intervals(shard_terms(spec, 0, head=150)) == ((5, 20), (100, 150))
    assert merge_intervals(shard_terms(spec, 1, head=50)) == ((1, 3),)  # 100- lies beyond the head
    assert merge_intervals(shard_terms(parse_range("2:1-"), 0, head=9)) == ()


def _resolved(*shards: ShardRange) -> ResolvedRange:
    return ResolvedRange(Q, RangeSpec(), tuple(shards))


def test_buckets_of_a_shard_range() -> None:
    shard = ShardRange(0, 300, ((60, 70), (200, 200)))
    assert shard.buckets == (0, 1, 3) and shard.batches == 12


def test_reads_cover_exactly_the_range_partitions_in_a_bounded_number_of_reads() -> None:
    cases = [
        _resolved(ShardRange(0, 75, ((60, 75),)), ShardRange(1001, 20, ((1, 20),)), ShardRange(1, 0, ())),
        _resolved(*[ShardRange(s, 64 * 100, ((1, 64 * 100),)) for s in range(16)]),
        _resolved(*[ShardRange(s, 10, ((1, 10),)) for s in range(256)]),
        _resolved(ShardRange(0, 64 * 9, ((1, 10), (64 * 8, 64 * 9)))),
    ]
    for resolved in cases:
        reads = plan_reads(resolved, max_reads=64)
        covered = [(s, b) for shards, buckets in reads for s in shards for b in buckets]
        wanted = [(s.shard, b) for s in resolved.shards for b in s.buckets]
        assert sorted(covered) == sorted(wanted) and len(covered) == len(set(covered))
        assert len(reads) <= 64 + len(resolved.shards)
    assert len(plan_reads(cases[2], max_reads=64)) <= 64
    assert plan_reads(_resolved(ShardRange(0, 0, ())), 64) == []


def test_timeuuid_clock_matches_python() -> None:
    """The Spark expression's arithmetic, checked in Python on a real version-1 UUID."""
    value = uuid.uuid1()
    text = str(value)
    hex_time = text[15:18] + text[9:13] + text[0:8]
    micros = (int(hex_time, 16) - 122192928000000000) // 10
    moment = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=micros)
    assert abs((moment - datetime.now(timezone.utc)).total_seconds()) < 5
    assert int(hex_time, 16) == value.time


def test_replay_waves_never_hold_two_messages_of_one_key() -> None:
    keys = ["a", None, "a", "b", None, "a", "b"]
    messages = [OutgoingMessage(str(i).encode(), key=k) for i, k in enumerate(keys)]
    got = waves(messages)
    assert [[m.payload for m in w] for w in got] == [[b"0", b"1", b"3", b"4"], [b"2", b"6"], [b"5"]]
    for wave in got:
        wave_keys = [m.key for m in wave if m.key is not None]
        assert len(wave_keys) == len(set(wave_keys))
    assert client_id(Q, 1001, 7, 3) == "replay:default/q:1001:7:3"


def test_session_settings() -> None:
    settings = Settings(cassandra_contact_points=["10.0.0.1", "10.0.0.2"], cassandra_port=9142,
                        cassandra_local_dc="dc1", consistency="LOCAL_QUORUM")
    local = spark_conf(settings, SparkOptions(connector="packages"))
    assert local["spark.master"] == "local[*]" and local["spark.ui.enabled"] == "false"
    assert local["spark.cassandra.connection.host"] == "10.0.0.1,10.0.0.2"
    assert local["spark.cassandra.connection.port"] == "9142"
    assert local["spark.cassandra.connection.localDC"] == "dc1"
    assert local["spark.sql.shuffle.partitions"] == "4"
    assert "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED" in local["spark.driver.extraJavaOptions"]
    assert local["spark.jars.packages"].startswith("com.datastax.spark:spark-cassandra-connector_2.12:")
    assert local["spark.jars.repositories"] == "https://repo1.maven.org/maven2/"
    remote = spark_conf(settings, SparkOptions(master="spark://m:7077", connector="packages",
                                               conf={"spark.executor.memory": "2g"}))
    assert "spark.ui.enabled" not in remote and "spark.driver.host" not in remote
    assert remote["spark.executor.memory"] == "2g"
    assert "--add-opens" in remote["spark.executor.extraJavaOptions"]
    # A cluster's executors run their own Python, if any: the driver's path is not theirs.
    assert "spark.pyspark.python" not in remote and "spark.pyspark.python" in local
    # A standalone cluster on loopback reaches the driver there; the UI stays on.
    here = spark_conf(settings, SparkOptions(master="spark://127.0.0.1:7077", connector="packages"))
    assert here["spark.driver.host"] == "127.0.0.1" and "spark.ui.enabled" not in here
    assert not on_this_machine("spark://127.0.0.1:7077,m:7077") and not on_this_machine("k8s://https://k:6443")
    assert on_this_machine("spark://localhost:7077,127.0.0.1:7078")


def test_session_settings_with_tls_make_java_stores_of_the_pem_files(tmp_path: Path) -> None:
    ca, ca_key = make_ca(tmp_path)
    crt, key = issue_cert(tmp_path, ca, ca_key, "client", client=True)
    tls = CassandraTlsSettings(enabled=True, ca_file=ca, cert_file=crt, key_file=key)
    conf = spark_conf(Settings(cassandra_tls=tls, cassandra_username="app", cassandra_password="pw-of-16-chars-at-least"),  # type: ignore[arg-type]
                      SparkOptions(connector="packages"))
    prefix = "spark.cassandra.connection.ssl."
    assert conf[f"{prefix}enabled"] == "true" and conf[f"{prefix}clientAuth.enabled"] == "true"
    assert conf["spark.cassandra.auth.password"] == "pw-of-16-chars-at-least"
    for store, holds in (("trustStore", "trustedCertEntry"), ("keyStore", "PrivateKeyEntry")):
        assert conf[f"{prefix}{store}.type"] == "PKCS12"
        listing = subprocess.run(["keytool", "-list", "-keystore", conf[f"{prefix}{store}.path"],
                                  "-storepass", conf[f"{prefix}{store}.password"]],
                                 capture_output=True, text=True, check=True).stdout
        assert holds in listing, listing
    # The system's CAs: TLS on, no stores.
    plain = spark_conf(Settings(cassandra_tls=CassandraTlsSettings(enabled=True)), SparkOptions(connector="packages"))
    assert plain[f"{prefix}enabled"] == "true" and not any(k.startswith(f"{prefix}trustStore") for k in plain)
    assert not any(k.startswith(prefix) for k in spark_conf(Settings(), SparkOptions(connector="packages")))


def test_session_settings_under_spark_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    """spark-submit started the driver's JVM: its master and its --jars/--packages stand."""
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "45678")
    conf = spark_conf(Settings(cassandra_contact_points=["10.0.0.1"]), SparkOptions(master=None, connector="packages"))
    assert not {"spark.master", "spark.jars", "spark.jars.packages"} & set(conf)
    assert conf["spark.cassandra.connection.host"] == "10.0.0.1"
    assert "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED" in conf["spark.executor.extraJavaOptions"]
