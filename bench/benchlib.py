"""What the benchmarks share: options, repeated runs and their report, the load pipeline,
the raw driver limits, percentiles.

Every benchmark measures each figure in `--runs` runs (3 by default) and reports the median
with the spread (min-max); a ratio is computed inside each run, against a limit measured in
that same run, and only then summarised. `--json` prints one JSON document instead of the
table (bench/all.py collects those); `--smoke` runs once with small counts, to prove the
benchmark still works, not to measure anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cassandra.query import BatchStatement, BatchType

from casque.backends import cql
from casque.config import Settings
from casque.schema import SCHEMA_CHANGE_TIMEOUT_SECONDS, bucket_of
from casque.store import Store


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_cpu(path: Path) -> float:
    """utime + stime from a /proc stat file, in seconds."""
    # The command name (field 2) may hold spaces: the fields that follow come after its ")".
    fields = path.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time so far of the processes, all their threads (the drivers' too);
    one that has ended counts nothing. (This process's own: time.process_time().)"""
    total = 0.0
    for pid in pids:
        try:
            total += _stat_cpu(Path(f"/proc/{pid}/stat"))
        except OSError:
            continue
    return total


def cpu_hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` busy processes, each taking a core if it can: a machine loaded by other work."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Each live thread's user + system CPU time so far, by its thread id."""
    found: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = _stat_cpu(task / "stat")
        except OSError:
            continue  # ended meanwhile
    return found


def thread_names(pid: int, spy: str) -> dict[int, str]:
    """The Python name of each thread of a Python process, by thread id (from `py-spy dump`);
    threads Python did not start are absent."""
    command = [spy, "dump", "--nonblocking", "--pid", str(pid)]
    # A dump that does not pause the process now and then reads a stack as it changes, and
    # fails: the third failure in a row is an error.
    for _ in range(2):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0:
            break
    else:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    return {int(tid): name for tid, name in re.findall(r'^Thread (\d+) \([^)]*\): "([^"]*)"', done.stdout,
                                                         re.MULTILINE)}


@dataclass(frozen=True)
class Figure:
    """One reported figure: its key in a run's results, what it is, and its unit."""

    key: str
    label: str
    unit: str  # "msgs/s", "rows/s", "ms", "s", "x" (a ratio) or "" (a count)


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def repeat(runs: int, once: Callable[[int], dict[str, float]]) -> dict[str, list[float]]:
    """once(run) for each run, its figures gathered by key."""
    samples: dict[str, list[float]] = {}
    for run in range(runs):
        for key, value in once(run).items():
            samples.setdefault(key, []).append(float(value))
        print(f"run {run + 1}/{runs} done", file=sys.stderr, flush=True)
    return samples


async def repeat_async(runs: int, once: Callable[[int], Awaitable[dict[str, float]]]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for run in range(runs):
        for key, value in (await once(run)).items():
            samples.setdefault(key, []).append(float(value))
        print(f"run {run + 1}/{runs} done", file=sys.stderr, flush=True)
    return samples


def _number(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}"
    if unit in ("ms", "s"):
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return f"{value:,.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.1f}"


def cell(figure: dict[str, Any], unit: str) -> str:
    """'median (min-max)' of a summarised figure, for tables."""
    if len(figure["values"]) == 1:
        return _number(figure["median"], unit)
    return (f"{_number(figure['median'], unit)} "
            f"({_number(figure['min'], unit)}-{_number(figure['max'], unit)})")


def report(name: str, args: argparse.Namespace, context: dict[str, Any], figures: Iterable[Figure],
           samples: dict[str, list[float]]) -> None:
    """Print the benchmark's figures: a table, or with --json one JSON document."""
    listed = [f for f in figures if f.key in samples]
    document = {
        "benchmark": name,
        "smoke": args.smoke,
        "runs": args.runs,
        "context": context,
        "figures": {f.key: {"label": f.label, "unit": f.unit, **summary(samples[f.key])} for f in listed},
    }
    bad = [f.key for f in listed if not all(math.isfinite(v) for v in samples[f.key])]
    if bad:
        raise SystemExit(f"{name}: figures that are not numbers: {bad}")
    if args.json:
        print(json.dumps(document, indent=1))
        return
    print(f"casque {name} benchmark: " + ", ".join(f"{k} {v}" for k, v in context.items()))
    print(f"median of {args.runs} run(s), (min-max)" + ("; SMOKE RUN, small counts: not figures" if args.smoke else ""))
    width = max(len(f.label) for f in listed)
    for f in listed:
        print(f"  {f.label:{width}s}  {cell(document['figures'][f.key], f.unit)} {f.unit}")


def run_in_process(name: str, description: str, once: Callable[[int, int], dict[str, float]],
                   figures: Iterable[Figure]) -> None:
    """The command line of a benchmark that needs no backend: `once(messages, seed)` per run,
    reported as the others are (--messages, --runs, --json, --smoke)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3, help="runs per figure; the median and min-max are reported")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--smoke", action="store_true", help="one run with small counts: proves it works")
    parser.add_argument("--cassandra", help="ignored: no backend is needed")
    parser.add_argument("--zookeeper", help="ignored: no backend is needed")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.messages = 1, 200
    samples = repeat(args.runs, lambda run: once(args.messages, run))
    report(name, args, {"messages": args.messages, "CPU": "process time"}, figures, samples)


async def pipeline(count: int, window: int, submit: Callable[[int], Awaitable[Any]]) -> float:
    """Run submit(i) for i < count with `window` calls in flight; returns seconds."""
    next_index = 0
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            i = next_index
            next_index += 1
            await submit(i)

    await asyncio.gather(*(worker() for _ in range(window)))
    return time.perf_counter() - started


def raw_insert_rate(store: Store, table: str, count: int, payload: bytes, window: int = 256) -> float:
    """Single-row inserts of message-like rows through the driver's own callback pipeline
    (its fastest form, no asyncio), `window` in flight: the node's write limit here."""
    insert = store.session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, message_id, published_at, payload) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    now = datetime.now(timezone.utc)
    slots = threading.Semaphore(window)
    finished = threading.Event()
    remaining = [count]
    lock = threading.Lock()

    def done(_: object = None) -> None:
        slots.release()
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                finished.set()

    started = time.perf_counter()
    for i in range(count):
        slots.acquire()
        batch = 1 + i // 100
        future = store.session.execute_async(insert, (900 + i % 4, bucket_of(batch), batch, i % 100, str(i), now, payload))
        future.add_callbacks(done, done)
    finished.wait()
    return count / (time.perf_counter() - started)


# Plain batches in flight for the batch limit: more than the one write per shard a publisher
# keeps in flight, so the limit is the node's, yet few enough bytes that the driver does not
# refuse requests as overloaded when its socket's send buffer fills (8 MiB in flight did).
BATCH_LIMIT_WINDOW = 32
BATCH_LIMIT_BYTES = 4 * 2**20


async def plain_batch_rate(store: Store, table: str, count: int, payload: bytes, batch_size: int,
                           window: int = BATCH_LIMIT_WINDOW, shard_base: int = 800) -> float:
    """Rows/s of plain unlogged single-partition batches of `batch_size` message rows,
    `window` in flight: the write limit a group commit of that batch size works against
    (the same rows, without the conditional claim and the header)."""
    insert = store.session.prepare(
        f"INSERT INTO {table} (shard, bucket, batch_no, seq, message_id, published_at, payload) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    now = datetime.now(timezone.utc)
    batches = max(1, count // batch_size)
    window = max(2, min(window, BATCH_LIMIT_BYTES // max(1, batch_size * len(payload))))

    async def plain_batch(i: int) -> None:
        statement = BatchStatement(batch_type=BatchType.UNLOGGED)
        for seq in range(batch_size):
            statement.add(insert, (shard_base + i % 4, bucket_of(i), i, seq, f"{i}-{seq}", now, payload))
        await cql.execute(store.session, statement)

    return batches * batch_size / await pipeline(batches, window, plain_batch)


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples` (seconds), in milliseconds."""
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000


def arguments(description: str, messages: int, size: int) -> argparse.ArgumentParser:
    """The options every benchmark takes: load size, runs, output, where the stack listens."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--messages", type=int, default=messages)
    parser.add_argument("--size", type=int, default=size)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="runs per figure; the median and min-max are reported")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--smoke", action="store_true",
                        help="one run with small counts: checks the benchmark works, measures nothing")
    parser.add_argument("--cassandra", default="127.0.0.1:9042")
    parser.add_argument("--zookeeper", default="127.0.0.1:2181")
    return parser


def parse(parser: argparse.ArgumentParser, smoke_messages: int) -> argparse.Namespace:
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
        args.messages = min(args.messages, smoke_messages)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def sidecar_url(process: subprocess.Popen[bytes], log: Path, limit_s: float = 120.0) -> str:
    """The URL a `casque sidecar --port 0` logs once it listens: the port the kernel gave it,
    so nothing picks a port here that someone else could bind first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = re.search(rb"casque sidecar listening on (http://\S+)", log.read_bytes())
        if found:
            return found.group(1).decode()
        if process.poll() is not None:
            raise SystemExit(f"sidecar exited: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise SystemExit(f"sidecar not listening after {limit_s:.0f}s: {log.read_text()[-2000:]}")


def text_payload(size: int) -> str:
    """A text message body of `size` characters, the same in every benchmark of the sidecar."""
    return ("casque-" * (size // 7 + 1))[:size]


def scratch_settings(cassandra: str, zookeeper: str, keyspace: str | None = None) -> Settings:
    """Settings for a keyspace and znode root of the benchmark's own (see `drop_scratch`).
    A benchmark's child processes pass the keyspace their parent's settings name, to share it."""
    host, _, port = cassandra.rpartition(":")
    keyspace = keyspace or f"bench_{uuid.uuid4().hex[:8]}"
    return Settings(cassandra_contact_points=[host], cassandra_port=int(port), consistency="ONE",
                    keyspace=keyspace, zookeeper_hosts=zookeeper, zookeeper_root=f"/bench-{keyspace}")


def drop_scratch(store: Store, settings: Settings) -> None:
    store.session.execute(f"DROP KEYSPACE IF EXISTS {settings.keyspace}", timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
    store.zk.delete(settings.zookeeper_root, recursive=True)
