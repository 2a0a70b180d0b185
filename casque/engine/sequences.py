"""Producer sequences: idempotency keys a producer numbers itself, recorded a run per row.

A client id is an arbitrary string, so the guard can find it again only through a row of
its own: every message with one costs a keyed read before its claim and a row written with
its intent. A producer that numbers its messages instead (a producer id it makes once, and
a sequence number per message) gives keys that sort: the sequences of one producer fall in
blocks of SEQUENCE_BLOCK, and one row per run of consecutive sequences that a writer's batch
carries within a block holds the intents of all of them, as lists. A group commit of 100
messages of one producer then costs one read and one row, not 100 of each.

Rows are clustered by their run's last sequence, so the read for a run of sequences starts
at its first and keeps only rows whose run begins by its last (a filter within the one
partition): a producer's first attempts read no row at all, and a retry reads the rows that
hold its sequences. A block's partition holds at most SEQUENCE_BLOCK sequences' rows and
lives for the window, so no partition grows with time.

From protocol 2 on (casque.engine.protocol) a first intent's row also carries what its
writer's row said for all the batch's keys (the first batch it claims, its claim deadline),
so a batch of producer keys alone writes no writer row, and no completion after its claim: a
retry finds the batch from the row's first batch by its writer, as it does for any intent. A
release before protocol 2 would look for the writer's row, find none, and publish the key
again; hence the switch.

Only first intents and the records of delayed messages (written before their rows in the
delayed table, see `delayed_publish.DelayedPublish`) are written here. What settles a key later
(its position found by a retry, an id taken over) is written to `client_ids` under the
key's string form (`producer_key`), exactly as for a client id; a key found here is
therefore also looked up there, and what is there wins (see idempotency).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from cassandra.query import BatchStatement, BatchType

from casque.backends import cql
from casque.formats import unmarked
from casque.schema import PRODUCER_SEQS_TABLE, has_columns
from casque.store import Store

# A producer key starts with two NULs: a client id holds no NUL, and a (source, id) key
# is NUL followed by a source, which is never empty.
PRODUCER_KEY_PREFIX = "\x00\x00"
SEQUENCE_BLOCK = 1024
MAX_SEQUENCE = 2**63 - 1
# Runs of one block read apart, at most: more (numbers not counted up one by one) are read
# as one span, filtered here.
MAX_RUN_READS = 8


class Sequenced(NamedTuple):
    """One message's key as its producer numbered it."""

    producer: str
    sequence: int


def producer_key(producer: str, sequence: int) -> str:
    """The idempotency key of a producer's message, as the engine's client ids are strings."""
    return f"{PRODUCER_KEY_PREFIX}{producer}\x00{sequence}"


@functools.lru_cache(maxsize=1024)
def parse_producer_key(key: str) -> Sequenced | None:
    """The (producer, sequence) of a producer key; None for any other client id. Kept for
    the last keys parsed: a batch's keys are parsed for its lookup and again for its intents."""
    if not key.startswith(PRODUCER_KEY_PREFIX):
        return None
    producer, _, sequence = key[len(PRODUCER_KEY_PREFIX):].rpartition("\x00")
    return Sequenced(producer, int(sequence))


@dataclass(frozen=True)
class BlockEntry:
    """What a block row says of one key: its message, where the writer put it in its batch,
    and the batch if the row was written with it (a delayed message's position, -1)."""

    key: str
    message_id: str
    shard: int
    seq: int
    writer: str
    batch_no: int | None
    ttl: int | None
    # Protocol 2: the writer's claim facts, on the row itself (None: on the writer's row).
    since_batch: int | None = None
    claim_deadline: datetime | None = None


class BlockRecord(NamedTuple):
    """One key to record: its message, shard, and seq in the batch (or position's seq)."""

    key: Sequenced
    message_id: str
    shard: int
    seq: int


class ClaimFacts(NamedTuple):
    """Where a writer's claims start and until when it may send them (protocol 2)."""

    since_batch: int
    claim_deadline: datetime


CLAIM_FACT_COLUMNS = {"since_batch", "claim_deadline"}


class SequenceBlocks:
    """The run rows of one queue's producer keys (PRODUCER_SEQS_TABLE)."""

    def __init__(self, store: Store, keyspace: str, queue_key: str, consistency: int) -> None:
        self._store = store
        self._keyspace = keyspace
        self._queue = queue_key
        self._consistency = consistency
        self.statements = 0
        self.claim_facts = False
        self._prepare()

    def _prepare(self) -> None:
        """The statements, with the claim-fact columns where the table has them (the operator
        adds them with its first apply after an upgrade, before any protocol 2 row exists)."""
        table = f"{self._keyspace}.{PRODUCER_SEQS_TABLE}"
        self.claim_facts = has_columns(self._store.session, self._keyspace, PRODUCER_SEQS_TABLE, CLAIM_FACT_COLUMNS)
        facts = ", since_batch, claim_deadline" if self.claim_facts else ""
        # Filtering within one partition's slice: no scan beyond the rows from `first` on.
        self._select = self._store.session.prepare(
            f"SELECT first_seq, writer, shard, batch_no, message_ids, batch_seqs, TTL(shard) AS ttl{facts} "
            f"FROM {table} WHERE queue = ? AND producer = ? AND block = ? AND last_seq >= ? AND first_seq <= ? "
            "ALLOW FILTERING"
        )
        self._insert = self._store.session.prepare(
            f"INSERT INTO {table} (queue, producer, block, last_seq, writer, first_seq, shard, batch_no, message_ids, "
            "batch_seqs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        self._insert_with_facts = self._store.session.prepare(
            f"INSERT INTO {table} (queue, producer, block, last_seq, writer, first_seq, shard, batch_no, message_ids, "
            "batch_seqs, since_batch, claim_deadline) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        ) if self.claim_facts else None
        for statement in (self._select, self._insert, self._insert_with_facts):
            if statement is not None:
                statement.consistency_level = self._consistency

    def ensure_claim_facts(self) -> bool:
        """Whether rows with claim facts are read and written; prepared again if the columns
        came since (a process that started before the operator's first apply)."""
        if not self.claim_facts:
            self._prepare()
        return self.claim_facts

    async def lookup(self, keys: Iterable[Sequenced]) -> dict[str, BlockEntry]:
        """Every recorded key among `keys`, by its string form: one read per run of
        consecutive sequences they hold within a block."""
        by_block: dict[tuple[str, int], list[int]] = {}
        for key in keys:
            by_block.setdefault((key.producer, key.sequence // SEQUENCE_BLOCK), []).append(key.sequence)
        reads = [(producer, block, first, last, set(sequences))
                 for (producer, block), sequences in by_block.items()
                 for first, last in _read_ranges(sorted(sequences))]
        self.statements += len(reads)
        pages = await asyncio.gather(*(
            cql.fetch_all(self._store.session, self._select, (self._queue, producer, block, first, last))
            for producer, block, first, last, _ in reads))
        found: dict[str, BlockEntry] = {}
        for (producer, _, _, _, wanted), rows in zip(reads, pages):
            for row in rows:
                for sequence, (message_id, seq) in enumerate(zip(row.message_ids, row.batch_seqs), row.first_seq):
                    if sequence in wanted:
                        text = producer_key(producer, sequence)
                        # Two rows for one key: two first attempts raced through two sidecars
                        # (see idempotency); the first found is kept, as a read would pick one.
                        writer = unmarked(row.writer, f"the writer of producer sequence {text!r}")
                        found.setdefault(text, BlockEntry(
                            text, message_id, row.shard, seq, writer, row.batch_no, row.ttl,
                            getattr(row, "since_batch", None), getattr(row, "claim_deadline", None)))
        return found

    async def record(self, records: Sequence[BlockRecord], writer: str, ttl: int, batch_no: int | None = None,
                     facts: ClaimFacts | None = None) -> None:
        """A row per run of consecutive sequences of `records` within a block and shard,
        under `writer`, with its claim facts if given (protocol 2, `ensure_claim_facts`):
        one unlogged batch per block partition, all at once."""
        if facts is not None and self._insert_with_facts is None:
            raise RuntimeError("claim facts asked for without their columns (ensure_claim_facts)")
        statement = self._insert if facts is None else self._insert_with_facts
        assert statement is not None
        extra: tuple[object, ...] = () if facts is None else (facts.since_batch, facts.claim_deadline)
        grouped: dict[tuple[str, int], list[BlockRecord]] = {}
        for record in records:
            grouped.setdefault((record.key.producer, record.key.sequence // SEQUENCE_BLOCK), []).append(record)
        statements = []
        for (producer, block), block_records in grouped.items():
            block_records.sort(key=lambda r: (r.shard, r.key.sequence))
            rows = [
                (self._queue, producer, block, run[-1].key.sequence, writer, run[0].key.sequence, run[0].shard,
                 batch_no, [r.message_id for r in run], [r.seq for r in run], *extra, ttl)
                for run in _record_runs(block_records)
            ]
            if len(rows) == 1:
                statements.append(statement.bind(rows[0]))
            else:
                batch = BatchStatement(batch_type=BatchType.UNLOGGED, consistency_level=self._consistency)
                for row in rows:
                    batch.add(statement, row)
                statements.append(batch)
        self.statements += len(statements)
        await asyncio.gather(*(cql.execute(self._store.session, statement) for statement in statements))


def _read_ranges(sequences: Sequence[int]) -> list[tuple[int, int]]:
    """The ranges to read for sorted `sequences` of one block: a read per run, unless they
    make more than MAX_RUN_READS runs (scattered numbers), then one read of the span."""
    found = runs(sequences)
    return found if len(found) <= MAX_RUN_READS else [(sequences[0], sequences[-1])]


def runs(sequences: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of consecutive numbers in sorted `sequences`, as (first, last)."""
    found: list[tuple[int, int]] = []
    if not sequences:
        return found
    first = last = sequences[0]
    for sequence in sequences[1:]:
        if sequence > last + 1:
            found.append((first, last))
            first = sequence
        last = sequence
    found.append((first, last))
    return found


def _record_runs(records: Sequence[BlockRecord]) -> list[list[BlockRecord]]:
    """`records` (sorted by shard, then sequence) cut where the shard changes or a sequence
    is skipped: each piece is one row. A sequence given twice stays in its piece once."""
    pieces: list[list[BlockRecord]] = []
    for record in records:
        if pieces:
            last = pieces[-1][-1]
            if record.shard == last.shard and record.key.sequence == last.key.sequence:
                continue
            if record.shard == last.shard and record.key.sequence == last.key.sequence + 1:
                pieces[-1].append(record)
                continue
        pieces.append([record])
    return pieces
