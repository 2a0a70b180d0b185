"""Finding and stopping the processes a stack started by their owner markers, pid file or not
(a killed test session's slot directory may have lost its pid files)."""

from __future__ import annotations

import sys
from pathlib import Path

from casque.devstack import processes


def _start(directory: Path) -> int:
    # A stand-in server: any long-lived process with the marker on its command line.
    return processes.spawn(directory, [sys.executable, "-c", "import time; time.sleep(120)",
                                       processes.owner_marker(directory)], "out.log")


def test_processes_under_a_root_are_found_and_stopped_without_pid_files(tmp_path: Path) -> None:
    root, other = tmp_path / "slot", tmp_path / "slot-1"
    _start(root / "a")
    _start(root / "b" / "c")
    stranger = _start(other / "a")
    try:
        assert processes.owned_under(root) == [(root / "a").resolve(), (root / "b" / "c").resolve()]
        (root / "a" / "pid").unlink()
        processes.stop_owned_under(root)
        assert processes.owned_under(root) == []
        assert processes.running_pid(other / "a") == stranger  # a neighbouring slot's is left alone
    finally:
        for directory in (root / "a", root / "b" / "c", other / "a"):
            processes.terminate(directory, grace_seconds=5)


def test_kill_is_a_crash_and_returns_the_pid(tmp_path: Path) -> None:
    pid = _start(tmp_path / "server")
    assert processes.kill(tmp_path / "server") == pid
    assert processes.running_pid(tmp_path / "server") is None
