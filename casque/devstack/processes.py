"""Background server processes that the local stack owns, found again through pid files.

A pid file alone is not proof: after a reboot the pid may belong to another program. Every
process we start carries a marker argument (`-Dcasque.owner=<dir>`), and a pid counts as
ours only while its command line still holds that marker, so `down` never kills a stranger.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from casque.errors import StackError


def owner_marker(directory: Path) -> str:
    return f"-Dcasque.owner={directory.resolve()}"


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def running_pid(directory: Path) -> int | None:
    """The pid of the live process started for `directory`, if there is one."""
    pid_file = directory / "pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if owner_marker(directory) in _cmdline(pid) and not _is_zombie(pid):
        return pid
    return None


def owned_under(root: Path) -> list[Path]:
    """The directories under `root` whose process runs now, found by the markers on the
    command lines (pid files can be gone: a killed session's directory may be half removed)."""
    prefix = f"-Dcasque.owner={root.resolve()}/"
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            for part in _cmdline(int(proc.name)):
                # A marker can also sit inside one argument, e.g. an environment assignment.
                at = part.find(prefix)
                if at >= 0:
                    found.add(Path(part[at + len("-Dcasque.owner="):].split()[0]))
    return sorted(found)


def stop_owned_under(root: Path) -> None:
    """Stop every process a stack or fixture started for a directory under `root`, pid file
    or not (SIGTERM, then SIGKILL)."""
    for directory in owned_under(root):
        pids = [int(proc.name) for proc in Path("/proc").iterdir()
                if proc.name.isdigit() and owner_marker(directory) in _cmdline(int(proc.name))]
        if pids:
            # terminate() goes by the pid file: write it again from what /proc shows.
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "pid").write_text(f"{pids[0]}\n")
            terminate(directory, grace_seconds=15.0)


def spawn(directory: Path, argv: Sequence[str], log_name: str) -> int:
    """Start `argv` detached from our session, output appended to `directory/log_name`."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / log_name
    # Keep one previous log, so that a startup failure is read from this start's lines only.
    rotate(log)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            list(argv),
            cwd=directory,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (directory / "pid").write_text(f"{process.pid}\n")
    # Until exec completes, /proc shows our own command line without the marker; wait for
    # it so that running_pid() is true from here on while the server lives.
    deadline = time.monotonic() + 10.0
    while running_pid(directory) is None and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.pid


def terminate(directory: Path, grace_seconds: float = 45.0) -> bool:
    """Stop the process started for `directory`: SIGTERM, then SIGKILL after the grace period.

    Returns whether a process was running.
    """
    pid = running_pid(directory)
    if pid is None:
        (directory / "pid").unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        _reap(pid)
        if running_pid(directory) is None:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            _reap(pid)
            if running_pid(directory) is None:
                break
            time.sleep(0.05)
        else:
            raise StackError(f"process {pid} for {directory} survived SIGKILL")
    (directory / "pid").unlink(missing_ok=True)
    return True


def kill(directory: Path) -> int:
    """SIGKILL the process, for fault tests (a crash: no shutdown, no goodbye to peers);
    returns its pid once it is gone."""
    pid = running_pid(directory)
    if pid is None:
        raise StackError(f"no running process for {directory}")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while running_pid(directory) is not None:
        if time.monotonic() > deadline:
            raise StackError(f"process {pid} for {directory} survived SIGKILL")
        _reap(pid)
        time.sleep(0.05)
    _reap(pid)
    return pid


def pause(directory: Path) -> None:
    """SIGSTOP the process: for fault tests (a paused server looks alive but answers nothing)."""
    pid = running_pid(directory)
    if pid is None:
        raise StackError(f"no running process for {directory}")
    stop(pid)


def stop(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP `pid` and return once every thread of it has stopped.

    The signal only asks: each thread stops when it is next scheduled, and on a loaded machine
    a server's threads can answer requests for a while after the kill returned."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise StackError(f"process {pid} did not stop within {timeout:.0f}s of SIGSTOP")
        time.sleep(0.005)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True  # gone: nothing of it runs
    for task in tasks:
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue  # a thread that exited meanwhile
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def resume(directory: Path) -> None:
    pid = running_pid(directory)
    if pid is None:
        raise StackError(f"no running process for {directory}")
    os.kill(pid, signal.SIGCONT)


def _reap(pid: int) -> None:
    # Only children of this process can be reaped; for others waitpid raises and the
    # /proc check alone decides.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def rotate(path: Path) -> None:
    """Move `path` aside (keeping one previous copy) so a new start writes a fresh log."""
    if path.exists():
        path.replace(path.with_name(path.name + ".1"))


def log_tail(path: Path, lines: int = 20) -> list[str]:
    try:
        content = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return content[-lines:]
