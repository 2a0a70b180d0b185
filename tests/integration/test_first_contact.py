"""The commands a new user copies first work as printed: every curl line of the README's
shell blocks and of what `scripts/run-local.sh` prints at its end, run with curl against a
real sidecar serving the demo queue, each answered with a 2xx; and the `casque publish` the
script prints, whose message the sidecar then hands out.

Only the address changes (the test's sidecar listens on a port of its own) and each
`<receipt ...>` placeholder becomes a real receipt from the receive that precedes it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import Client
from tests.fixtures.doc_examples import ROOT, command_lines, examples
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import unavailable

QUEUE = "demo"  # what run-local.sh creates and the README names
SUBSCRIBER = "demo-app"
README_ADDRESS = "localhost:8717"
PLACEHOLDER = re.compile(r"<receipt[^>]*>")
HEREDOC = re.compile(r"^cat <<TXT\n(.*?)^TXT$", re.MULTILINE | re.DOTALL)


def readme_commands(address: str) -> list[str]:
    commands = [e.command.replace("\\\n", " ") for e in examples(ROOT / "README.md") if e.words[0] == "curl"]
    assert all(README_ADDRESS in command for command in commands), commands
    return [command.replace(README_ADDRESS, address) for command in commands]


def run_local_tips(api: str, state: Path) -> str:
    """What run-local.sh prints after starting its sidecar, rendered by bash as the script does."""
    script = (ROOT / "scripts" / "run-local.sh").read_text()
    heredoc = HEREDOC.search(script)
    assert heredoc, "run-local.sh no longer prints its tips from `cat <<TXT`"
    variables = {"api": api, "queue": QUEUE, "subscriber": SUBSCRIBER, "pidfile": str(state / "sidecar.pid")}
    program = "".join(f"{name}={shlex.quote(value)}\n" for name, value in variables.items())
    program += f"cat <<TXT\n{heredoc.group(1)}TXT\n"
    return subprocess.run(["bash", "-c", program], check=True, capture_output=True, text=True).stdout


def run_as_printed(commands: list[str], curl: str) -> list[tuple[str, int, str]]:
    """Run each command through curl; (command, HTTP status, body). A receive's receipts feed the
    placeholders of the commands after it, one receipt each."""
    receipts: list[str] = []
    answers = []
    for command in commands:
        while PLACEHOLDER.search(command):
            assert receipts, f"no receipt left from an earlier receive for {command}"
            command = PLACEHOLDER.sub(receipts.pop(0), command, count=1)
        argv = shlex.split(command, comments=True)
        assert argv[0] == "curl"
        done = subprocess.run([curl, *argv[1:], "--max-time", "60", "--write-out", "\n%{http_code}"],
                              check=True, capture_output=True, text=True)
        body, _, status = done.stdout.rpartition("\n")
        answers.append((command, int(status), body))
        if "/receive" in command and status.startswith("2"):
            receipts.extend(m["receipt"] for m in json.loads(body)["messages"])
    return answers


@pytest.fixture
def demo_sidecar(store: Store, start_sidecar: Callable[..., SidecarProcess]) -> SidecarProcess:
    """A sidecar on the queue and subscriber run-local.sh makes, with the same specs."""
    ref = QueueRef("default", QUEUE)
    catalog.apply_queue(store, ref, QueueSpec(shards=2, retention_seconds=86400, consistency="ONE"))
    catalog.apply_subscriber(store, ref, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=30))
    return start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER)


@pytest.fixture
def curl() -> str:
    found = shutil.which("curl")
    if found is None:
        unavailable("curl is not installed (apt-get install curl)")
    return found


def test_the_readme_commands_work_as_printed(demo_sidecar: SidecarProcess, curl: str) -> None:
    address = demo_sidecar.url.removeprefix("http://")
    commands = readme_commands(address)
    assert any("/receive" in c for c in commands) and any(PLACEHOLDER.search(c) for c in commands)
    for command, status, body in run_as_printed(commands, curl):
        assert 200 <= status < 300, (command, status, body)


def test_the_commands_run_local_prints_work_as_printed(
    demo_sidecar: SidecarProcess, curl: str, tmp_path: Path, backends: Backends, keyspace: str, zk_hosts: str,
    store: Store,
) -> None:
    tips = run_local_tips(demo_sidecar.url, tmp_path)
    commands = command_lines(tips)
    placeholders = sum(len(PLACEHOLDER.findall(c)) for c in commands)
    assert placeholders >= 2 and any("/nack" in c for c in commands) and any("/seek" in c for c in commands)
    # The script's own demo publishes before these are printed; here one message per receipt
    # the printed commands use stands in for it, so the printed receive hands out enough.
    with Client(demo_sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        client.publish_batch([{"data": {"order": i}} for i in range(placeholders)])
    for command, status, body in run_as_printed(commands, curl):
        assert 200 <= status < 300, (command, status, body)
    # The terminal's publish, as printed (tail and stats --watch run until stopped; dev status
    # and dev down are about the local stack, which this test does not run).
    (publish,) = command_lines(tips, ".venv/bin/casque publish ")
    environment = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root)}
    done = subprocess.run(shlex.split(publish), cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    with Client(demo_sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        seen: list[object] = []
        while {"hello": "cli"} not in seen:
            received = client.receive(max=100, wait=5)
            assert received, f"the CLI's message never came; got {seen}"
            seen.extend(m.data for m in received)
