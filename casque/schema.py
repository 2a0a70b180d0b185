"""The Cassandra schema of casque: one keyspace per installation, one messages table per queue.

The messages table is insert-only. A queue is an append-only log of numbered batches; a
batch's rows share one partition `(shard, bucket)` with `bucket = batch // batches_per_bucket`,
so partitions stay bounded and a batch can be claimed and written in one conditional
single-partition batch. Data leaves only by TTL: the table's `default_time_to_live` is the
queue's retention and TimeWindowCompactionStrategy groups rows by write time, so whole
SSTables expire together and no read walks tombstones.

This module is the only place that writes DDL; the operator, the sidecar, the CLI and the
Spark jobs import the names from here.
"""

from __future__ import annotations

import hashlib
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any

from casque.errors import InvalidSpec

# Kubernetes object names for queues and subscribers: DNS labels. The text keeps `^...$` for
# the CRDs' and pydantic's patterns, where `$` ends the text; Python's `$` also matches before
# a final newline, so Python code checks names with `fullmatch` (is_name), never `match`.
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

# The header row of a batch has this seq; message rows count from 0.
HEADER_SEQ = -1

# A batch's rows stay under this many bytes (one conditional write, one mutation far below
# the commit log's limit) unless a single message is larger, and a bucket holds this many
# batches: the largest partition is about their product (64 MiB). Fixed for all queues,
# because readers compute buckets from batch numbers.
MAX_BATCH_BYTES = 1024 * 1024
BATCHES_PER_BUCKET = 64

# Tombstones from TTL expiry are purged after this. Zero would disable hints for the table
# (Cassandra keeps hints no longer than gc_grace_seconds), so keep the default hint window.
GC_GRACE_SECONDS = 3 * 3600

MIN_RETENTION_SECONDS = 60
MAX_RETENTION_SECONDS = 10 * 365 * 86400
TWCS_TARGET_WINDOWS = 24

ACKS_TABLE = "acks"
# Client message ids of idempotent publishes, a queue's ids spread over CLIENT_ID_BUCKETS
# partitions: one group commit's ids are checked with one read and recorded with one
# write per partition, not one per id.
CLIENT_IDS_TABLE = "client_ids"
CLIENT_ID_BUCKETS = 16
# A row per writer id (per group commit): where its claims start and until when, written
# with the intents of its ids, and the batch it won, which completes all of them.
PUBLISH_WRITERS_TABLE = "publish_writers"
# The table of one partition per id that CLIENT_IDS_TABLE replaces. Installations made
# before it keep it; sidecars look there for ids they miss until it is dropped.
LEGACY_PUBLISH_IDS_TABLE = "publish_ids"
# Producer keys (a producer id and a sequence number per message): one row per block of a
# producer's sequences and group commit, instead of one per id (casque.engine.sequences).
PRODUCER_SEQS_TABLE = "producer_seqs"
DELAYED_TABLE = "delayed"
COUNTERS_TABLE = "counters"
# Queues' and subscribers' states as the installation applied them, and the positions ZooKeeper
# coordinates, checkpointed so that a ZooKeeper that lost its data is rebuilt from them
# (casque.engine.checkpoints).
CATALOG_TABLE = "catalog"
CHECKPOINTS_TABLE = "checkpoints"
# Delayed messages are grouped in partitions of this many seconds of due time.
DELAY_BUCKET_SECONDS = 60


def is_name(text: str) -> bool:
    """Whether `text` is a DNS label, the whole of it (a trailing newline included)."""
    return NAME_PATTERN.fullmatch(text) is not None


def validate_name(kind: str, name: str) -> str:
    if not is_name(name):
        raise InvalidSpec(
            f"{kind} name {name!r} must be a DNS label: lowercase letters, digits and '-', at most 63"
        )
    return name


@dataclass(frozen=True, order=True)
class QueueRef:
    """A queue's identity: the Kubernetes namespace and name of its Queue resource.

    The local stack (no Kubernetes) uses the namespace "default".
    """

    namespace: str
    name: str

    def __post_init__(self) -> None:
        validate_name("namespace", self.namespace)
        validate_name("queue", self.name)

    @classmethod
    def parse(cls, text: str) -> QueueRef:
        """`name` or `namespace/name`."""
        namespace, _, name = text.rpartition("/")
        return cls(namespace or "default", name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def key(self) -> str:
        """The queue's key in shared tables."""
        return f"{self.namespace}/{self.name}"

    @property
    def messages_table(self) -> str:
        # Table names allow [a-zA-Z0-9_]{1,48}; the readable prefix may collide after
        # truncation, the hash of the full identity does not.
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:10]
        readable = self.name.replace("-", "_")[:30]
        return f"m_{readable}_{digest}"


def bucket_of(batch: int, batches_per_bucket: int = BATCHES_PER_BUCKET) -> int:
    return batch // batches_per_bucket


def client_id_bucket(client_id: str) -> int:
    """The partition of CLIENT_IDS_TABLE (within its queue) that holds a client id: crc32,
    not Python's hash, so every process agrees."""
    return zlib.crc32(client_id.encode()) % CLIENT_ID_BUCKETS


def validate_retention(seconds: int) -> int:
    if not MIN_RETENTION_SECONDS <= seconds <= MAX_RETENTION_SECONDS:
        raise InvalidSpec(
            f"retention must be between {MIN_RETENTION_SECONDS}s and {MAX_RETENTION_SECONDS}s, got {seconds}s"
        )
    return seconds


def twcs_window(retention_seconds: int) -> tuple[str, int]:
    """The TWCS window for a retention: about 24 windows over the retention period.

    Fewer, larger windows mean fewer SSTables to read; more windows mean expired data is
    dropped sooner. Cassandra's guidance is 20 to 30 windows.
    """
    validate_retention(retention_seconds)
    window = retention_seconds / TWCS_TARGET_WINDOWS
    if window < 3600:
        return "MINUTES", max(1, math.ceil(window / 60))
    if window < 86400:
        return "HOURS", math.ceil(window / 3600)
    return "DAYS", math.ceil(window / 86400)


def _compaction(retention_seconds: int) -> str:
    unit, size = twcs_window(retention_seconds)
    # unchecked_tombstone_compaction lets a fully expired SSTable be dropped even when it
    # overlaps older ones.
    return (
        "{'class': 'TimeWindowCompactionStrategy', "
        f"'compaction_window_unit': '{unit}', 'compaction_window_size': {size}, "
        "'unchecked_tombstone_compaction': 'true'}"
    )


def keyspace_ddl(keyspace: str, replication_cql: str) -> str:
    return f"CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = {replication_cql}"


def messages_table_ddl(keyspace: str, queue: QueueRef, retention_seconds: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS {keyspace}.{queue.messages_table} (
    shard int,
    bucket bigint,
    batch_no bigint,
    seq int,
    message_id text,
    published_at timestamp,
    key text,
    -- frozen: inserting a non-frozen collection writes a deletion marker first
    attributes frozen<map<text, text>>,
    payload blob,
    content_type text,
    client_id text,
    expires_at timestamp,
    writer text,
    message_count int,
    total_messages bigint,
    total_bytes bigint,
    PRIMARY KEY ((shard, bucket), batch_no, seq)
) WITH CLUSTERING ORDER BY (batch_no ASC, seq ASC)
  AND default_time_to_live = {validate_retention(retention_seconds)}
  AND gc_grace_seconds = {GC_GRACE_SECONDS}
  AND compaction = {_compaction(retention_seconds)}
  AND comment = 'casque queue {queue.key}'"""


def alter_retention_ddl(keyspace: str, queue: QueueRef, retention_seconds: int) -> str:
    """New retention applies to rows written from now on; existing rows keep their TTL."""
    return (
        f"ALTER TABLE {keyspace}.{queue.messages_table} WITH default_time_to_live = "
        f"{validate_retention(retention_seconds)} AND compaction = {_compaction(retention_seconds)}"
    )


def drop_messages_table_ddl(keyspace: str, queue: QueueRef) -> str:
    """Used only by the Delete deletion policy of a Queue: the table goes whole, never row by row."""
    return f"DROP TABLE IF EXISTS {keyspace}.{queue.messages_table}"


def shared_tables_ddl(keyspace: str) -> list[str]:
    """Tables shared by all queues of the installation. Rows carry their own TTL."""
    return [
        # What a subscriber has done with messages of batches that are not complete yet,
        # so that a new lease holder skips acked messages and keeps delivery counts.
        # Each write adds one row per batch (a fresh `entry` id) holding the seqs it
        # covers; rows are never updated or deleted and expire with the queue's retention.
        # `epoch` changes with every seek, so a replay does not see the acks of the
        # previous pass. `outcome` is 'ack' or 'dead' (dead-lettered); `deliveries` maps
        # seq to its delivery count at a redelivery, `visible_until` to the delivery's (or its
        # extension's) visibility deadline in ms.
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{ACKS_TABLE} (
    queue text,
    subscriber text,
    epoch int,
    shard int,
    bucket bigint,
    batch_no bigint,
    entry timeuuid,
    outcome text,
    seqs frozen<set<int>>,
    deliveries frozen<map<int, int>>,
    visible_until frozen<map<int, bigint>>,
    PRIMARY KEY ((queue, subscriber, epoch, shard, bucket), batch_no, entry)
) WITH CLUSTERING ORDER BY (batch_no ASC, entry ASC)
  AND gc_grace_seconds = {GC_GRACE_SECONDS}
  AND compaction = {_compaction(7 * 86400)}""",
        # Delayed messages wait here, by due time (seed 003's time shards), until the queue's
        # elected mover publishes them into the log. Rows expire after due time + retention.
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{DELAYED_TABLE} (
    queue text,
    due_bucket bigint,
    due_at timestamp,
    message_id text,
    published_at timestamp,
    key text,
    attributes frozen<map<text, text>>,
    payload blob,
    content_type text,
    priority int,
    ttl_seconds int,
    PRIMARY KEY ((queue, due_bucket), due_at, message_id)
) WITH CLUSTERING ORDER BY (due_at ASC, message_id ASC)
  AND gc_grace_seconds = {GC_GRACE_SECONDS}
  AND compaction = {_compaction(7 * 86400)}""",
        # Running counts for statistics (delayed in and out, dead-lettered). Counter updates
        # are increments, not deletes.
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{COUNTERS_TABLE} (
    queue text,
    name text,
    value counter,
    PRIMARY KEY ((queue), name)
)""",
        # Each queue's and subscriber's state as applied (JSON), read only when ZooKeeper lost
        # them: the queue's incarnation, which keys every other shared row, comes back with
        # it. Used in the installation's keyspace only, which no namespace can write.
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{CATALOG_TABLE} (
    queue text,
    subscriber text,
    state text,
    format int,
    PRIMARY KEY ((queue), subscriber)
)""",
        # Positions per queue incarnation, owner (a shard's head, or a subscriber incarnation's
        # offset) and shard: max registers, written USING TIMESTAMP of the position itself
        # (epoch above batch), so the highest ever written wins whatever order writes land in.
        # One row per shard for the queue's life: no TTL, nothing deleted.
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{CHECKPOINTS_TABLE} (
    queue text,
    owner text,
    shard int,
    epoch int,
    batch_no bigint,
    total_messages bigint,
    total_bytes bigint,
    format int,
    PRIMARY KEY ((queue, owner), shard)
)""",
        # Client message ids of recent publishes, for idempotent publish; rows expire
        # after the deduplication window. Written as an intent before the claim (writer, and
        # seq: the message's place in its batch; the writer's row in publish_writers says
        # where and until when it claims), and completed by the writer's row once the batch
        # is written (or here, with batch_no, by a retry that settled it). A queue's ids share CLIENT_ID_BUCKETS partitions
        # (`client_id_bucket`), so a group commit reads and writes a few partitions however
        # many ids it carries; at 5,000 ids/s and a 600 s window a partition holds about
        # 190,000 rows (~30 MB).
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{CLIENT_IDS_TABLE} (
    queue text,
    bucket int,
    client_id text,
    message_id text,
    shard int,
    batch_no bigint,
    seq int,
    writer text,
    PRIMARY KEY ((queue, bucket), client_id)
) WITH gc_grace_seconds = {GC_GRACE_SECONDS}
  AND compaction = {_compaction(86400)}""",
        # Intents of producer keys, a row per run of consecutive sequences that one writer's
        # batch carries within a block of SEQUENCE_BLOCK sequences of a producer: each
        # sequence's message id and seq in the batch (or, with batch_no, the position of a
        # message that waited in the delayed table). Clustered by the run's last sequence, so
        # a read of a run of sequences skips the rows before it and filters the rest within
        # its one partition. Rows expire after the deduplication window; a block's partition
        # never holds more than its sequences. From protocol 2 on (casque.engine.protocol) an
        # intent's row carries its writer's claim facts (since_batch, claim_deadline) itself.
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{PRODUCER_SEQS_TABLE} (
    queue text,
    producer text,
    block bigint,
    last_seq bigint,
    writer text,
    first_seq bigint,
    shard int,
    batch_no bigint,
    message_ids frozen<list<text>>,
    batch_seqs frozen<list<int>>,
    since_batch bigint,
    claim_deadline timestamp,
    PRIMARY KEY ((queue, producer, block), last_seq, writer)
) WITH gc_grace_seconds = {GC_GRACE_SECONDS}
  AND compaction = {_compaction(86400)}""",
        # A writer id (one per group commit): written with its intents, where its claims
        # start and until when they may be sent; once written, the batch it won. Lives as
        # long as its ids. A writer that took an id over names the writers it replaced whose
        # last claim may still land on its first batch (`replaces`).
        f"""CREATE TABLE IF NOT EXISTS {keyspace}.{PUBLISH_WRITERS_TABLE} (
    queue text,
    writer text,
    shard int,
    since_batch bigint,
    claim_deadline timestamp,
    batch_no bigint,
    replaces set<text>,
    PRIMARY KEY ((queue, writer))
) WITH gc_grace_seconds = {GC_GRACE_SECONDS}
  AND compaction = {_compaction(86400)}""",
    ]


# The tables a namespace's sidecars write to consume (ack rows, delivery counters, offset
# checkpoints and the catalog's copies): writable still while a stored-bytes quota stops the
# namespace's publishes, so that its consumers drain what it holds.
CONSUMING_TABLES = (ACKS_TABLE, COUNTERS_TABLE, CHECKPOINTS_TABLE, CATALOG_TABLE)


def namespace_role_cql(role: str, password: str, keyspace: str,
                       publishing: bool = True) -> list[tuple[str, tuple[str, ...]]]:
    """A namespace's role (keyspace isolation, casque.tenancy): created if absent, its
    password set, and rights to read and write rows of `keyspace` only (`namespace_writes_cql`).
    No CREATE, ALTER, DROP or AUTHORIZE: the operator alone changes the schema and the
    grants. Statements with their values (the password is bound, never spliced into the text)."""
    return [
        (f'CREATE ROLE IF NOT EXISTS "{role}" WITH PASSWORD = %s AND LOGIN = true', (password,)),
        (f'ALTER ROLE "{role}" WITH PASSWORD = %s', (password,)),
        (f'GRANT SELECT ON KEYSPACE {keyspace} TO "{role}"', ()),
        *((statement, ()) for statement in namespace_writes_cql(role, keyspace, publishing)),
    ]


def namespace_writes_cql(role: str, keyspace: str, publishing: bool) -> list[str]:
    """What the role may write: every table of its keyspace, or, while the namespace may not
    publish (over its stored-bytes quota), the CONSUMING_TABLES alone. A grant on a
    keyspace covers its tables and cannot be taken back table by table, so the narrow form
    names tables and drops the keyspace's grant; each change grants before it revokes, so a
    consumer's writes are never refused on the way."""
    tables = [f"{keyspace}.{table}" for table in CONSUMING_TABLES]
    if publishing:
        return [f'GRANT MODIFY ON KEYSPACE {keyspace} TO "{role}"',
                *(f'REVOKE MODIFY ON TABLE {table} FROM "{role}"' for table in tables)]
    return [*(f'GRANT MODIFY ON TABLE {table} TO "{role}"' for table in tables),
            f'REVOKE MODIFY ON KEYSPACE {keyspace} FROM "{role}"']


def drop_role_cql(role: str) -> str:
    return f'DROP ROLE IF EXISTS "{role}"'


@dataclass(frozen=True)
class TableOptions:
    """What Cassandra reports of a messages table, to compare with the wanted state."""

    exists: bool
    default_time_to_live: int = 0
    compaction: dict[str, str] | None = None


# Columns added to shared tables after their first release: (table, column, type). A table
# an installation does not have (a legacy one) gets none.
ADDED_COLUMNS = [
    (LEGACY_PUBLISH_IDS_TABLE, "writer", "text"),
    (LEGACY_PUBLISH_IDS_TABLE, "since_batch", "bigint"),
    (LEGACY_PUBLISH_IDS_TABLE, "claim_deadline", "timestamp"),
    (PUBLISH_WRITERS_TABLE, "replaces", "set<text>"),
    (ACKS_TABLE, "visible_until", "frozen<map<int, bigint>>"),
    (PRODUCER_SEQS_TABLE, "since_batch", "bigint"),
    (PRODUCER_SEQS_TABLE, "claim_deadline", "timestamp"),
]


# A schema change waits for every live node to agree on the new schema: on a ring of busy
# nodes that outlasts the driver's 10 s request timeout, while the change itself goes on.
SCHEMA_CHANGE_TIMEOUT_SECONDS = 60.0


def ensure_keyspace(session: Any, keyspace: str, replication_cql: str) -> None:
    session.execute(keyspace_ddl(keyspace, replication_cql), timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
    for ddl in shared_tables_ddl(keyspace):
        session.execute(ddl, timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
    # An installation made by an earlier version gets the columns it lacks.
    existing = {
        (row.table_name, row.column_name)
        for row in session.execute(
            "SELECT table_name, column_name FROM system_schema.columns WHERE keyspace_name = %s", (keyspace,)
        )
    }
    tables = {table for table, _ in existing}
    for table, column, kind in ADDED_COLUMNS:
        if table in tables and (table, column) not in existing:
            session.execute(f"ALTER TABLE {keyspace}.{table} ADD {column} {kind}",
                            timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)


def ensure_queue_table(session: Any, keyspace: str, queue: QueueRef, retention_seconds: int) -> bool:
    """Create the queue's table, or change its retention if it differs. Returns whether anything changed."""
    current = read_table_options(session, keyspace, queue)
    if not current.exists:
        session.execute(messages_table_ddl(keyspace, queue, retention_seconds), timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
        return True
    unit, size = twcs_window(retention_seconds)
    compaction = current.compaction or {}
    if (
        current.default_time_to_live != retention_seconds
        or compaction.get("compaction_window_unit") != unit
        or compaction.get("compaction_window_size") != str(size)
    ):
        session.execute(alter_retention_ddl(keyspace, queue, retention_seconds), timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
        return True
    return False


def read_table_options(session: Any, keyspace: str, queue: QueueRef) -> TableOptions:
    row = session.execute(
        "SELECT default_time_to_live, compaction FROM system_schema.tables "
        "WHERE keyspace_name = %s AND table_name = %s",
        (keyspace, queue.messages_table),
    ).one()
    if row is None:
        return TableOptions(exists=False)
    return TableOptions(
        exists=True, default_time_to_live=int(row.default_time_to_live), compaction=dict(row.compaction)
    )


def has_table(session: Any, keyspace: str, table: str) -> bool:
    row = session.execute(
        "SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s AND table_name = %s", (keyspace, table)
    ).one()
    return row is not None


def has_columns(session: Any, keyspace: str, table: str, columns: set[str]) -> bool:
    rows = session.execute(
        "SELECT column_name FROM system_schema.columns WHERE keyspace_name = %s AND table_name = %s", (keyspace, table))
    return columns <= {row.column_name for row in rows}


def count_queue_tables(session: Any, keyspace: str) -> int:
    """Tables in the keyspace; Cassandra slows down past a few hundred, so the operator warns near 200."""
    rows = session.execute(
        "SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s", (keyspace,)
    )
    return sum(1 for row in rows if row.table_name.startswith("m_"))
