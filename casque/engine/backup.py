"""Backups of an installation's state, and their restore into an empty pair of backends.

Everything casque must keep is in Cassandra: the queues' logs, the ack rows, delayed messages,
publish ids, counters, the catalog of queues and subscribers and the checkpoints of every
position (casque.engine.checkpoints). ZooKeeper's part is rebuilt from those by the next
apply (casque.engine.rebuild), so a backup is of Cassandra's rows alone.

A backup is a directory: `manifest.json` (format, time, keyspaces, tables and their columns,
row counts) and one gzipped JSON-lines file per table. Each row keeps every cell's value with
its write time and its remaining TTL, so a restore writes the same cells `USING TIMESTAMP`
of their write (the checkpoints' max registers keep their order, a later write still wins)
and `USING TTL` of what was left at the backup less the time since: retention runs on as
if nothing had happened, and a row that would have expired meanwhile is not restored.

Tables are read in an order that keeps a backup taken under traffic consistent, each read
of a table standing for a moment later than the one before:
catalog, checkpoints, acks, then the logs, then publish ids, then delayed messages, then counters.
- checkpoints before logs: no offset or head points past a batch the backup lacks;
- acks before logs: a message acked after its ack rows were read is delivered again
  (at least once), never lost;
- publish ids after logs: every message in the backed-up log has its id's record (an
  id's intent is written before its batch), so a retry after a restore is deduplicated;
- delayed messages after logs and ids: a delayed row moved into the log before the logs were
  read is in both, and its move's id record is there too, so moving it again stores nothing;
  one moved after is in the delayed table only, and moved once after the restore.

Counters are restored as increments (Cassandra counters take nothing else).
A logical backup reads every row through the driver: for an installation of many
gigabytes, Cassandra's own snapshots (`nodetool snapshot`, `nodetool import`) of the same
keyspaces restore the same state faster, and the apply rebuilds ZooKeeper the same way.
"""

from __future__ import annotations

import base64
import gzip
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cassandra.concurrent import execute_concurrent_with_args
from cassandra.query import SimpleStatement

from casque.engine.checkpoints import QUEUE_RECORD
from casque.errors import InvalidSpec, NewerFormat
from casque.schema import (
    ACKS_TABLE,
    CATALOG_TABLE,
    CHECKPOINTS_TABLE,
    CLIENT_IDS_TABLE,
    COUNTERS_TABLE,
    DELAYED_TABLE,
    LEGACY_PUBLISH_IDS_TABLE,
    PRODUCER_SEQS_TABLE,
    PUBLISH_WRITERS_TABLE,
    SCHEMA_CHANGE_TIMEOUT_SECONDS,
    QueueRef,
    ensure_keyspace,
    messages_table_ddl,
)
from casque.specs import QueueState
from casque.store import Store
from casque.tenancy import namespace_keyspace

FORMAT = 1
MANIFEST = "manifest.json"
# Before the logs, in this order; the logs; then these (module docstring: why).
BEFORE_LOGS = (CATALOG_TABLE, CHECKPOINTS_TABLE, ACKS_TABLE)
AFTER_LOGS = (CLIENT_IDS_TABLE, PRODUCER_SEQS_TABLE, PUBLISH_WRITERS_TABLE, LEGACY_PUBLISH_IDS_TABLE, DELAYED_TABLE,
              COUNTERS_TABLE)
# Rows read per page, and written at once on restore.
PAGE_ROWS = 1000
CONCURRENT_WRITES = 64
QUEUE_TABLE_COMMENT = "casque queue "


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # partition_key, clustering, regular, static
    type: str

    @property
    def key(self) -> bool:
        return self.kind in ("partition_key", "clustering")

    @property
    def multi_cell(self) -> bool:
        """A collection that is not frozen: its cells have no one write time to read."""
        return self.type.startswith(("set<", "list<", "map<"))


@dataclass
class TableReport:
    keyspace: str
    table: str
    rows: int = 0


@dataclass
class Report:
    """What a backup or restore did: rows per table, and what was left out."""

    tables: list[TableReport] = field(default_factory=list)
    expired_cells: int = 0

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)


# --- backup ---------------------------------------------------------------------------------
def backup(store: Store, directory: Path) -> Report:
    """Write every casque row of the installation into `directory` (which must be empty or new)."""
    if directory.exists() and any(directory.iterdir()):
        raise InvalidSpec(f"{directory} is not empty: a backup goes into a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    keyspaces = _keyspaces(store)
    manifest: dict[str, Any] = {"format": FORMAT, "startedAt": started.isoformat(),
                                "installationKeyspace": store.keyspace, "isolation": store.isolation, "keyspaces": {}}
    report = Report()
    for phase in ("before", "logs", "after"):
        for keyspace in keyspaces:
            for table, options in _tables(store, keyspace, phase):
                columns = _columns(store, keyspace, table)
                rows = _dump(store, keyspace, table, columns, directory / keyspace / f"{table}.jsonl.gz")
                manifest["keyspaces"].setdefault(keyspace, {})[table] = {
                    "columns": [[c.name, c.kind, c.type] for c in columns], "rows": rows, **options}
                report.tables.append(TableReport(keyspace, table, rows))
    manifest["finishedAt"] = datetime.now(timezone.utc).isoformat()
    # Written last: a directory without it is a backup that did not finish.
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return report


def _keyspaces(store: Store) -> list[str]:
    """The installation's keyspace and, with keyspace isolation, every namespace's that has a queue."""
    if not store.isolation:
        return [store.keyspace]
    rows = store.session.execute(f"SELECT queue FROM {store.keyspace}.{CATALOG_TABLE}")
    namespaces = sorted({QueueRef.parse(row.queue).namespace for row in rows})
    return [store.keyspace, *(namespace_keyspace(store.keyspace, ns) for ns in namespaces)]


def _tables(store: Store, keyspace: str, phase: str) -> Iterator[tuple[str, dict[str, Any]]]:
    rows = store.session.execute(
        "SELECT table_name, default_time_to_live, comment FROM system_schema.tables WHERE keyspace_name = %s",
        (keyspace,))
    found = {row.table_name: row for row in rows}
    if phase == "logs":
        for name, row in sorted(found.items()):
            if name.startswith("m_") and (row.comment or "").startswith(QUEUE_TABLE_COMMENT):
                yield name, {"queue": row.comment[len(QUEUE_TABLE_COMMENT):],
                             "retentionSeconds": int(row.default_time_to_live)}
        return
    for name in BEFORE_LOGS if phase == "before" else AFTER_LOGS:
        if name in found:
            yield name, {}


def _columns(store: Store, keyspace: str, table: str) -> list[Column]:
    rows = store.session.execute(
        "SELECT column_name, kind, type, position FROM system_schema.columns WHERE keyspace_name = %s "
        "AND table_name = %s", (keyspace, table))
    order = {"partition_key": 0, "clustering": 1, "static": 2, "regular": 3}
    ordered = sorted(rows, key=lambda r: (order[r.kind], r.position, r.column_name))
    return [Column(r.column_name, r.kind, r.type) for r in ordered]


def _dump(store: Store, keyspace: str, table: str, columns: list[Column], path: Path) -> int:
    keys = [c for c in columns if c.key]
    cells = [c for c in columns if not c.key]
    timed = [c for c in cells if not c.multi_cell and c.type != "counter"]
    selected = [_quote(c.name) for c in columns]
    selected += [f"TTL({_quote(c.name)}), WRITETIME({_quote(c.name)})" for c in timed]
    statement = SimpleStatement(f"SELECT {', '.join(selected)} FROM {keyspace}.{table}", fetch_size=PAGE_ROWS)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for row in store.session.execute(statement):
            values = list(row)
            key = [_encode(c.type, v) for c, v in zip(keys, values[:len(keys)])]
            by_cell = dict(zip((c.name for c in cells), values[len(keys):len(columns)]))
            times = values[len(columns):]
            groups: dict[tuple[int | None, int | None], dict[str, Any]] = {}
            latest: tuple[int | None, int | None] = (None, None)
            for index, column in enumerate(timed):
                value = by_cell[column.name]
                if value is None:
                    continue
                ttl, written = times[2 * index], times[2 * index + 1]
                groups.setdefault((ttl, written), {})[column.name] = _encode(column.type, value)
                if latest[1] is None or (written or 0) > latest[1]:
                    latest = (ttl, written)
            for column in cells:
                if column in timed or by_cell[column.name] is None:
                    continue
                # A collection's cells or a counter: written with the row's latest cells.
                groups.setdefault(latest, {})[column.name] = _encode(column.type, by_cell[column.name])
            if not groups:
                groups[(None, None)] = {}  # a row of its key alone
            out.write(json.dumps({"k": key, "g": [[ttl, written, cells_] for (ttl, written), cells_ in groups.items()]},
                                 separators=(",", ":")) + "\n")
            count += 1
    return count


# --- restore --------------------------------------------------------------------------------
def restore(store: Store, directory: Path) -> Report:
    """Write a backup's rows into the installation `store` points at: its keyspaces and tables
    made first. An apply of the queues (the operator's, or `casque apply -f`) then rebuilds
    their znodes from the catalog and checkpoints restored here."""
    manifest = read_manifest(directory)
    if manifest["installationKeyspace"] != store.keyspace:
        raise InvalidSpec(f"the backup is of keyspace {manifest['installationKeyspace']!r}; this installation's "
                          f"is {store.keyspace!r} (CASQUE_KEYSPACE)")
    taken = datetime.fromisoformat(manifest["startedAt"])
    elapsed = max(0, int((datetime.now(timezone.utc) - taken).total_seconds()))
    report = Report()
    for keyspace, tables in manifest["keyspaces"].items():
        ensure_keyspace(store.session, keyspace, store.replication_cql)
        for table, options in tables.items():
            if "queue" in options:
                ref = QueueRef.parse(options["queue"])
                store.session.execute(messages_table_ddl(keyspace, ref, int(options["retentionSeconds"])),
                                      timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
    # Every cell is written with its own write time: the order of the writes does not matter.
    for keyspace, tables in manifest["keyspaces"].items():
        for table, options in tables.items():
            columns = [Column(*c) for c in options["columns"]]
            rows, expired = _load(store, keyspace, table, columns, directory / keyspace / f"{table}.jsonl.gz", elapsed)
            report.tables.append(TableReport(keyspace, table, rows))
            report.expired_cells += expired
    return report


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise InvalidSpec(f"{directory} holds no finished backup (no {MANIFEST})")
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except ValueError as error:
        raise InvalidSpec(f"{path} is not a backup manifest: {error}") from error
    if int(manifest.get("format", 0)) > FORMAT:
        raise NewerFormat(f"the backup in {directory} is in format {manifest['format']}; this version of casque "
                          f"restores up to {FORMAT}")
    return manifest


def _load(store: Store, keyspace: str, table: str, columns: list[Column], path: Path,
          elapsed: int) -> tuple[int, int]:
    keys = [c for c in columns if c.key]
    by_name = {c.name: c for c in columns}
    counters = [c for c in columns if c.type == "counter"]
    prepared: dict[tuple[str, ...], Any] = {}
    writes: dict[Any, list[tuple[Any, ...]]] = {}
    rows = expired = 0
    with gzip.open(path, "rt", encoding="utf-8") as source:
        for line in source:
            record = json.loads(line)
            key = tuple(_decode(c.type, v) for c, v in zip(keys, record["k"]))
            rows += 1
            for ttl, written, cells in record["g"]:
                if counters and not cells:
                    continue
                if counters:
                    for name, value in cells.items():
                        statement = _prepared(store, prepared, keyspace, table, keys, (name,), counter=True)
                        writes.setdefault(statement, []).append((value, *key))
                    continue
                left = None if ttl is None else int(ttl) - elapsed
                if left is not None and left <= 0:
                    expired += len(cells)
                    continue
                names = tuple(sorted(cells))
                statement = _prepared(store, prepared, keyspace, table, keys, names, ttl=left is not None,
                                      timestamp=written is not None)
                values = [*key, *(_decode(by_name[n].type, cells[n]) for n in names)]
                if left is not None:
                    values.append(left)
                if written is not None:
                    values.append(int(written))
                writes.setdefault(statement, []).append(tuple(values))
            if sum(len(v) for v in writes.values()) >= PAGE_ROWS:
                _flush(store, writes)
    _flush(store, writes)
    return rows, expired


def _prepared(store: Store, cache: dict[tuple[str, ...], Any], keyspace: str, table: str, keys: list[Column],
              names: tuple[str, ...], ttl: bool = False, timestamp: bool = False, counter: bool = False) -> Any:
    signature = (*names, f"ttl={ttl}", f"timestamp={timestamp}", f"counter={counter}")
    if signature not in cache:
        if counter:
            (name,) = names
            where = " AND ".join(f"{_quote(c.name)} = ?" for c in keys)
            text = f"UPDATE {keyspace}.{table} SET {_quote(name)} = {_quote(name)} + ? WHERE {where}"
        else:
            columns = [*(c.name for c in keys), *names]
            using = " AND ".join(part for part, wanted in (("TTL ?", ttl), ("TIMESTAMP ?", timestamp)) if wanted)
            text = (f"INSERT INTO {keyspace}.{table} ({', '.join(map(_quote, columns))}) "
                    f"VALUES ({', '.join('?' for _ in columns)})" + (f" USING {using}" if using else ""))
        cache[signature] = store.session.prepare(text)
    return cache[signature]


def _flush(store: Store, writes: dict[Any, list[tuple[Any, ...]]]) -> None:
    for statement, values in writes.items():
        execute_concurrent_with_args(store.session, statement, values, concurrency=CONCURRENT_WRITES,
                                     raise_on_first_error=True)
    writes.clear()


def queues_in(directory: Path) -> list[tuple[QueueRef, QueueState | None]]:
    """The queues a backup holds, with their recorded state where the catalog has it (for a report)."""
    manifest = read_manifest(directory)
    found: dict[QueueRef, QueueState | None] = {}
    for tables in manifest["keyspaces"].values():
        for options in tables.values():
            if "queue" in options:
                found.setdefault(QueueRef.parse(options["queue"]), None)
    catalog = directory / manifest["installationKeyspace"] / f"{CATALOG_TABLE}.jsonl.gz"
    if catalog.is_file():
        with gzip.open(catalog, "rt", encoding="utf-8") as source:
            for line in source:
                record = json.loads(line)
                queue, subscriber = record["k"]
                state = next((cells.get("state") for _, _, cells in record["g"] if "state" in cells), None)
                if subscriber == QUEUE_RECORD and state is not None:
                    found[QueueRef.parse(queue)] = QueueState.model_validate_json(state)
    return sorted(found.items(), key=lambda item: str(item[0]))


# --- values ---------------------------------------------------------------------------------
def _quote(name: str) -> str:
    return f'"{name}"'


def _arguments(type_: str) -> tuple[str, list[str]]:
    """`map<int, bigint>` -> ("map", ["int", "bigint"]); `frozen<...>` is looked through."""
    while type_.startswith("frozen<"):
        type_ = type_[len("frozen<"):-1]
    if "<" not in type_:
        return type_, []
    outer, inner = type_.split("<", 1)
    inner = inner[:-1]
    parts, depth, start = [], 0, 0
    for index, char in enumerate(inner):
        depth += char == "<"
        depth -= char == ">"
        if char == "," and depth == 0:
            parts.append(inner[start:index].strip())
            start = index + 1
    parts.append(inner[start:].strip())
    return outer, parts


def _encode(type_: str, value: Any) -> Any:
    if value is None:
        return None
    outer, args = _arguments(type_)
    if outer in ("set", "list"):
        return [_encode(args[0], v) for v in value]
    if outer == "map":
        return [[_encode(args[0], k), _encode(args[1], v)] for k, v in value.items()]
    if outer == "blob":
        return base64.b64encode(value).decode()
    if outer == "timestamp":
        moment = value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
        return int(moment.timestamp() * 1000)
    if outer in ("uuid", "timeuuid"):
        return str(value)
    return value


def _decode(type_: str, value: Any) -> Any:
    if value is None:
        return None
    outer, args = _arguments(type_)
    if outer == "set":
        return {_decode(args[0], v) for v in value}
    if outer == "list":
        return [_decode(args[0], v) for v in value]
    if outer == "map":
        return {_decode(args[0], k): _decode(args[1], v) for k, v in value}
    if outer == "blob":
        return base64.b64decode(value)
    if outer == "timestamp":
        return datetime.fromtimestamp(value / 1000, tz=timezone.utc)
    if outer in ("uuid", "timeuuid"):
        return uuid.UUID(value)
    return value
