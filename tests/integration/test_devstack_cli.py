"""`casque dev up/status/logs/down` as a user runs them: a real stack, its own ports and state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.waiting import free_port

CLI = [sys.executable, "-m", "casque.cli"]




# Ports of their own, so that a stack left behind by an interrupted run cannot get in the way.
CQL, STORAGE, JMX, ZOOKEEPER = (free_port() for _ in range(4))
PORTS = ["--cql-port", str(CQL), "--storage-port", str(STORAGE), "--jmx-port", str(JMX),
         "--zookeeper-port", str(ZOOKEEPER)]


def casque(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [*CLI, "dev", *args, "--state-dir", str(state)], capture_output=True, text=True, env=env, timeout=400
    )


def owned_processes(state: Path) -> list[str]:
    marker = f"-Dcasque.owner={state.resolve()}"
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(proc.name)
    return found


@pytest.mark.integration
def test_up_twice_status_logs_and_down_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "stack"
    try:
        first = casque("up", *PORTS, state=state)
        assert first.returncode == 0, first.stderr
        assert f"127.0.0.1:{CQL}" in first.stdout and f"127.0.0.1:{ZOOKEEPER}" in first.stdout
        assert len(owned_processes(state)) == 2

        again = casque("up", state=state)  # settings come from the recorded stack
        assert again.returncode == 0, again.stderr
        assert "starting" not in again.stdout
        assert len(owned_processes(state)) == 2

        status = casque("status", state=state)
        assert status.returncode == 0
        assert "cassandra-1" in status.stdout and "stopped" not in status.stdout

        logs = casque("logs", "cassandra-1", "-n", "200", state=state)
        assert "Startup complete" in logs.stdout

        bad = casque("logs", "nope", state=state)
        assert bad.returncode == 1
        assert bad.stderr.strip().startswith("casque: unknown service 'nope'")
    finally:
        down = casque("down", state=state)
    assert down.returncode == 0, down.stderr
    assert owned_processes(state) == []
    stopped = casque("status", state=state)
    assert stopped.returncode == 3
    assert stopped.stdout.count("stopped") == 2


@pytest.mark.integration
def test_status_without_a_stack_is_one_readable_line(tmp_path: Path) -> None:
    result = casque("status", state=tmp_path / "none")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "run `casque dev up`" in result.stderr
