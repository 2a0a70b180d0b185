"""`casque dev up/status/logs/down` and `scripts/run-local.sh` as a user runs them: a real
stack on its own ports and state (Cassandra and a three-member ZooKeeper ensemble), and the
sidecar the script starts on it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from casque.devstack.stack import Stack, StackPorts
from tests.fixtures.stack import Slot, claim_slot
from tests.fixtures.waiting import wait_for

CLI = [sys.executable, "-m", "casque.cli"]
REPO = Path(__file__).resolve().parents[2]
# Cassandra cannot listen on port 0, so the ports come from a slot held (locked) for this
# session, apart from the test stack's and the ring's: a stack left behind by an interrupted
# run, or another session's, cannot get in the way, and nothing else picks these ports.
# Below the ephemeral range (see tests/fixtures/stack.py), and apart from every other slot's.
DEV_PORTS = StackPorts(native=13042, storage=10000, jmx=10199, zookeeper=8181,
                       zookeeper_quorum=8881, zookeeper_election=8981)
ZOOKEEPERS = 3

pytestmark = pytest.mark.integration


def casque(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [*CLI, "dev", *args, "--state-dir", str(state)], capture_output=True, text=True, env=env, timeout=400
    )


def owned_processes(state: Path) -> list[str]:
    # The owner is `state` or a directory below it, never one that only starts with its name:
    # another session's dev stack lives in `<state>-1`.
    marker = re.compile(re.escape(f"-Dcasque.owner={state.resolve()}") + "(/|\x00|$)")
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker.search(cmdline):
                found.append(proc.name)
    return found


def connect_string(ports: StackPorts) -> str:
    return ",".join(f"127.0.0.1:{ports.zookeeper + n}" for n in range(ZOOKEEPERS))


@pytest.fixture(scope="module")
def dev_stack() -> Iterator[tuple[Path, StackPorts]]:
    """A stack started by `casque dev up` on the slot's ports; `down` at the end in any case."""
    slot: Slot = claim_slot(Path(os.environ.get("CASQUE_TEST_DEV_DIR", "/tmp/casque-test-dev")), DEV_PORTS)
    state, ports = slot.root, slot.ports
    # Whatever a killed session of this slot left behind is stopped and forgotten: the slot's
    # lock says nobody else uses it.
    casque("down", state=state)
    shutil.rmtree(state, ignore_errors=True)
    try:
        first = casque("up", "--cql-port", str(ports.native), "--storage-port", str(ports.storage),
                       "--jmx-port", str(ports.jmx), "--zookeeper-port", str(ports.zookeeper),
                       "--zookeeper-nodes", str(ZOOKEEPERS), "--zookeeper-quorum-port", str(ports.zookeeper_quorum),
                       "--zookeeper-election-port", str(ports.zookeeper_election), state=state)
        assert first.returncode == 0, first.stderr
        assert f"127.0.0.1:{ports.native}" in first.stdout
        assert f"ZooKeeper: {connect_string(ports)}" in first.stdout
        yield state, ports
    finally:
        casque("down", state=state)
        slot.lock.close()


def test_up_twice_status_and_logs(dev_stack: tuple[Path, StackPorts]) -> None:
    state, ports = dev_stack
    assert len(owned_processes(state)) == 1 + ZOOKEEPERS

    again = casque("up", state=state)  # settings come from the recorded stack
    assert again.returncode == 0, again.stderr
    assert "starting" not in again.stdout
    assert len(owned_processes(state)) == 1 + ZOOKEEPERS

    status = casque("status", state=state)
    assert status.returncode == 0
    assert "cassandra-1" in status.stdout and "stopped" not in status.stdout
    for n in range(ZOOKEEPERS):
        assert f"zookeeper-{n + 1}" in status.stdout and f"127.0.0.1:{ports.zookeeper + n}" in status.stdout
    # Each member has its own data and id, and all of them serve: one leads, the others follow.
    assert {(state / f"zookeeper-{n}" / "data" / "myid").read_text().strip() for n in (1, 2, 3)} == {"1", "2", "3"}
    recorded = Stack.load(state)
    assert recorded is not None
    assert sorted(map(str, recorded.zookeeper().modes().values())) == ["follower", "follower", "leader"]

    other = casque("up", "--zookeeper-nodes", "1", state=state)
    assert other.returncode == 1 and "run `casque dev down` first" in other.stderr
    even = casque("up", "--zookeeper-nodes", "2", state=state)
    assert even.returncode == 1 and "odd number" in even.stderr

    logs = casque("logs", "cassandra-1", "-n", "200", state=state)
    assert "Startup complete" in logs.stdout

    bad = casque("logs", "nope", state=state)
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("casque: unknown service 'nope'")


def _call(url: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read() or b"null")


def test_run_local_serves_the_demo_queue(dev_stack: tuple[Path, StackPorts]) -> None:
    state, ports = dev_stack
    env = {
        **os.environ,
        "CASQUE_STATE_DIR": str(state),  # `dev up` in the script finds this stack running
        "CASQUE_SIDECAR_PORT": "0",  # the sidecar takes a free port; the script reads it from its log
        "CASQUE_CASSANDRA_CONTACT_POINTS": "127.0.0.1",
        "CASQUE_CASSANDRA_PORT": str(ports.native),
        "CASQUE_ZOOKEEPER_HOSTS": connect_string(ports),
    }
    done = subprocess.run(["bash", "scripts/run-local.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    started = re.search(r"sidecar on (http://127\.0\.0\.1:\d+) \(pid (\d+)", done.stdout)
    pid = int(started.group(2)) if started else None
    try:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert started, done.stdout
        api = started.group(1)
        assert "acked" in done.stdout and "queue default/demo" in done.stdout  # the demo ran to its stats
        _call(f"{api}/readyz")  # 200, or urlopen raises

        base = f"{api}/v1/queues/demo"
        _call(f"{base}/messages", {"data": {"from": "the test"}, "partitionkey": "k1"})
        received: list[dict[str, Any]] = []

        def ours() -> bool:
            received.extend(_call(f"{base}/subscribers/demo-app/receive", {"max": 100, "wait": 5})["messages"])
            return any(m.get("data") == {"from": "the test"} for m in received)

        wait_for("the test's message through the script's sidecar", ours)
        _call(f"{base}/subscribers/demo-app/ack", {"receipts": [m["receipt"] for m in received]})
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)  # the sidecar the script started: it drains, then exits
            wait_for("the script's sidecar to exit", lambda: not Path(f"/proc/{pid}").exists(), timeout=60)


def test_down_leaves_nothing(dev_stack: tuple[Path, StackPorts]) -> None:
    state, _ = dev_stack
    down = casque("down", state=state)
    assert down.returncode == 0, down.stderr
    assert owned_processes(state) == []
    stopped = casque("status", state=state)
    assert stopped.returncode == 4  # a stopped service: backend unavailable (casque/cli/exits.py)
    assert stopped.stdout.count("stopped") == 1 + ZOOKEEPERS


def test_status_without_a_stack_is_one_readable_line(tmp_path: Path) -> None:
    result = casque("status", state=tmp_path / "none")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "run `casque dev up`" in result.stderr
