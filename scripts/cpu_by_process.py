"""Where a run's CPU went: CPU seconds by kind of process, sampled from /proc.

    python scripts/cpu_by_process.py --while PID [--every 2] [--top 25] [--processes 30]

Samples every process's user and system time every `--every` seconds until process PID
ends (or SIGTERM/SIGINT), then prints the CPU seconds of each kind of process (Cassandra,
ZooKeeper, sidecars, the API server, ...), the machine's busy CPU from /proc/stat beside
them, and how much of the run the cores were saturated. The suite is bound by CPU on two
cores, so this says what a cut in suite time has to take out.

With `--processes N` it lists the N costliest processes too, each with where it ran (a
Cassandra node's storage directory, a ZooKeeper's configuration, else its working directory):
which of the suite's many Cassandra nodes cost what.

A process is counted up to its last sample: one that lives less than a sample's interval is
missed, and what the kinds do not cover shows as "unattributed" (the machine's busy time
less the sampled processes'). Most of that is processes that ended between two samples (the
last moments of each, or all of a short one). The kernel adds what a process used to the
CPU of its children in its parent's /proc stat when the parent reaps it; less what the
samples saw of those children, that is their unsampled CPU, which the report gives by the
kind of process that started them.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import NamedTuple

TICKS = os.sysconf("SC_CLK_TCK")
# A Java process by its main class, a Python one by what it runs, any other by its program:
# the first kind whose every word is in the part of the command line that says what it is
# (paths in the other arguments name test directories, not the process).
JAVA_KINDS: tuple[tuple[str, str], ...] = (
    ("cassandra", "CassandraDaemon"),
    ("cassandra tools (nodetool, sstable tools)", "org.apache.cassandra"),
    ("zookeeper", "org.apache.zookeeper"),
    ("spark", "org.apache.spark"),
    ("openapi-generator", "openapi-generator"),
)
PYTHON_KINDS: tuple[tuple[str, str], ...] = (
    ("pytest workers", "exec(eval(sys.stdin"),  # how execnet starts xdist's workers
    ("pytest", "pytest"),
    ("spark python workers", "pyspark"),
)


def kind_of(argv: list[str]) -> str:
    if not argv:
        return "kernel threads"
    program = Path(argv[0]).name
    line = " ".join(argv)
    if program == "java":
        # The main class (or -jar) follows the options; a classpath names every jar, so skip it.
        tail = " ".join(arg for arg, before in zip(argv[1:], argv) if before not in ("-cp", "-classpath"))
        return next((kind for kind, word in JAVA_KINDS if word in tail), "other java")
    if program.startswith("python") or program in ("casque", "pytest", "coverage"):
        # `python -m casque.cli sidecar`, or the `casque` script (`python .../bin/casque operator`).
        entry = next((i for i, arg in enumerate(argv) if arg == "casque.cli" or Path(arg).name == "casque"), None)
        if entry is not None:
            command = argv[entry + 1] if entry + 1 < len(argv) else ""
            return command if command in ("sidecar", "operator") else "casque CLI"
        return next((kind for kind, word in PYTHON_KINDS if word in line), "other python")
    return program or "kernel threads"


class Stat(NamedTuple):
    started: str  # in ticks since boot: a pid is reused, a start is not
    cpu: float  # its own CPU seconds so far
    children_cpu: float  # the CPU seconds of the children it has reaped (and theirs)
    parent: str


def _stat(pid: str) -> Stat | None:
    """What /proc says of the process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return Stat(fields[19], (int(fields[11]) + int(fields[12])) / TICKS, (int(fields[13]) + int(fields[14])) / TICKS,
                fields[1])


def _argv(pid: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _where(pid: str, argv: list[str]) -> str:
    """Which of its kind a process is: a Java server by the state directory its options
    name, any other by its working directory."""
    for prefix in ("-Dcassandra.storagedir=", "-Dzookeeper.datadir=", "-Dspark.local.dir="):
        found = next((arg[len(prefix):] for arg in argv if arg.startswith(prefix)), None)
        if found:
            return found
    if argv and Path(argv[0]).name == "java" and argv[-1].endswith(".cfg"):
        return argv[-1]  # ZooKeeper's QuorumPeerMain takes its configuration file last
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return "?"


def _machine_busy_and_total() -> tuple[float, float]:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return (total - idle) / TICKS, total / TICKS


class Sampler:
    def __init__(self) -> None:
        self.me = str(os.getpid())
        # (pid, start) -> (kind, CPU seconds at the first sample, at the last one)
        self.seen: dict[tuple[str, str], tuple[str, float, float]] = {}
        self.where: dict[tuple[str, str], str] = {}
        # (pid, start) -> (its parent's pid, its reaped children's CPU at the first sample, at the last)
        self.reaped: dict[tuple[str, str], tuple[str, float, float]] = {}
        self.alive: set[tuple[str, str]] = set()  # as of the last sample
        self.last_sample: dict[tuple[str, str], int] = {}  # (pid, start) -> the last sample that saw it
        self.busy_start, self.total_start = _machine_busy_and_total()
        self.samples = 0
        self.saturated = 0
        self._last_busy, self._last_total = self.busy_start, self.total_start

    def sample(self) -> None:
        alive = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if pid == self.me:
                continue
            read = _stat(pid)
            if read is None:
                continue
            started, cpu = read.started, read.cpu
            key = (pid, started)
            alive.add(key)
            self.last_sample[key] = self.samples
            reaped = self.reaped.get(key)
            self.reaped[key] = (read.parent, read.children_cpu if reaped is None else reaped[1], read.children_cpu)
            known = self.seen.get(key)
            # Named again at every sample: a container's entrypoint script execs its server.
            argv = _argv(pid)
            kind = kind_of(argv) if argv or known is None else known[0]  # empty: it just ended
            if known is None:
                # Counted from its start when it began during the run, else from now.
                began_before = not self.samples
                self.seen[key] = (kind, cpu if began_before else 0.0, cpu)
                self.where[key] = _where(pid, argv)
            else:
                self.seen[key] = (kind, known[1], cpu)
        busy, total = _machine_busy_and_total()
        if total > self._last_total and (busy - self._last_busy) / (total - self._last_total) >= 0.9:
            self.saturated += 1
        self._last_busy, self._last_total = busy, total
        self.alive = alive
        self.samples += 1

    def ended_between_samples(self) -> dict[str, float]:
        """The CPU seconds of children that no sample saw, by the kind of their parent: what
        each parent reaped during the run, less what the samples saw of its children that
        ended (their own and their reaped children's)."""
        children: dict[str, list[tuple[str, str]]] = {}
        for key, (parent, _, _) in self.reaped.items():
            children.setdefault(parent, []).append(key)

        def handed_to_parent(key: tuple[str, str]) -> float:
            """What an ended process gave its parent when reaped, as far as the samples saw:
            its own CPU and its reaped children's at its last sample, and what its children
            still alive then gave it after (a shell that reaps its jobs as it exits)."""
            last = self.last_sample.get(key, 0)
            later = sum(handed_to_parent(child) for child in children.get(key[0], [])
                        if child not in self.alive and child in self.seen and self.last_sample.get(child, -1) >= last)
            return self.seen[key][2] + self.reaped[key][2] + later

        seen_of_ended: dict[str, float] = {}
        for key, (parent, _, _) in self.reaped.items():
            if key not in self.alive and key in self.seen:
                seen_of_ended[parent] = seen_of_ended.get(parent, 0.0) + handed_to_parent(key)
        by_parent_kind: dict[str, float] = {}
        for key, (_, children_first, children_last) in self.reaped.items():
            unseen = children_last - children_first - seen_of_ended.get(key[0], 0.0)
            if unseen > 0:
                kind = self.seen[key][0]
                by_parent_kind[kind] = by_parent_kind.get(kind, 0.0) + unseen
        return by_parent_kind

    def report(self, wall: float, top: int, processes_listed: int = 0) -> str:
        by_kind: dict[str, float] = {}
        processes: dict[str, int] = {}
        for kind, first, last in self.seen.values():
            by_kind[kind] = by_kind.get(kind, 0.0) + last - first
            processes[kind] = processes.get(kind, 0) + 1
        busy, total = _machine_busy_and_total()
        machine_busy = busy - self.busy_start
        cores = (total - self.total_start) / wall if wall else 0.0
        lines = [f"CPU by kind of process over {wall:.0f} s of wall time ({cores:.1f} cores):"]
        heaviest = sorted(by_kind.items(), key=lambda item: -item[1])[:top]
        lines += [f"{seconds:9.0f} s  {kind} ({processes[kind]} processes)" for kind, seconds in heaviest
                  if seconds >= 0.5]
        attributed = sum(by_kind.values())
        lines.append(f"{max(machine_busy - attributed, 0.0):9.0f} s  unattributed (processes shorter than a sample)")
        unseen = sorted(self.ended_between_samples().items(), key=lambda item: -item[1])
        lines += [f"{seconds:9.0f} s    of it ended between samples, started by {kind}" for kind, seconds in unseen[:top]
                  if seconds >= 0.5]
        lines.append(f"{machine_busy:9.0f} s  the machine's busy CPU "
                     f"({machine_busy / (total - self.total_start) * 100:.0f}% of its cores' time)")
        if self.samples:
            share = self.saturated * 100 / self.samples
            lines.append(f"cores at least 90% busy in {share:.0f}% of {self.samples} samples")
        if processes_listed:
            lines.append(f"the {processes_listed} costliest processes:")
            costliest = sorted(self.seen.items(), key=lambda item: item[1][1] - item[1][2])[:processes_listed]
            lines += [f"{last - first:9.0f} s  {kind}  {self.where.get(key, '?')}"
                      for key, (kind, first, last) in costliest]
        return "\n".join(lines)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--while", dest="watched", type=int, required=True, help="sample while this process lives")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--processes", type=int, default=0, help="list this many of the costliest processes too")
    parser.add_argument("--out", type=Path, help="write the report here too")
    args = parser.parse_args()
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sampler = Sampler()
    started = time.monotonic()
    while not stopping and _alive(args.watched):
        sampler.sample()
        time.sleep(args.every)
    sampler.sample()
    report = sampler.report(time.monotonic() - started, args.top, args.processes)
    print(report, flush=True)
    if args.out is not None:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
