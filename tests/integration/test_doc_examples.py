"""Every curl and casque command in the shell blocks of docs/*.md works as printed, on the
test's Cassandra and ZooKeeper and a real `casque sidecar`: a curl line is answered with a
2xx (a 4xx where the document shows an error on purpose) and a casque command exits 0 (or as
the document shows), and where the document prints the answer, the answer is that one
(doc_examples.Template: `…` is what the document leaves out).

Each document runs in order, in a keyspace and chroot of its own, on the queues it describes
(its own YAML where it has one: WORLDS), from a scratch directory holding the files its
commands name. What changes from the printed command, and nothing else (`Reading`):
  - `localhost:8717` is the test sidecar's address, `.../` the path of the receive before it;
  - a receipt placeholder (`"AAAA…"`, `"…"`) is a receipt the sidecar handed out; within one
    block a name is one receipt (an ack of `AAAA…` and a later one both ack that delivery);
  - a message id is the first one a publish of the document answered with;
  - `/backups/…` and `/tmp/…` are under the scratch directory, a directory per block.
Commands that cannot run here are in ALLOW_LIST with the reason, and lines of other programs
(kubectl, helm, ...) in OTHER_PROGRAMS: a command that is in neither and does not run fails.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tracemalloc
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from casque.store import Store
from tests.fixtures.doc_examples import ELLIPSIS, ROOT, Example, Template, examples, yaml_blocks
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.stack import Backends, drop_keyspace
from tests.fixtures.waiting import unavailable, wait_for

DOCS = sorted((ROOT / "docs").glob("*.md"))
DOC_ADDRESS = "localhost:8717"
# (document, how the command starts): why it does not run against the local stack.
ALLOW_LIST = {
    ("docs/operator.md", "casque operator run"): "needs a Kubernetes API server (tests/integration/test_operator.py)",
    ("docs/spark.md", "casque spark stats --queue"): "needs Spark (tests/integration/test_spark.py)",
    ("docs/spark.md", "casque spark export"): "needs Spark (tests/integration/test_spark.py)",
    ("docs/spark.md", "casque spark replay"): "needs Spark (tests/integration/test_spark.py)",
    ("docs/spark.md", "casque spark stats -q orders --master"): "needs a Spark cluster (test_spark_cluster.py)",
    ("docs/cli.md", "casque --install-completion"): "writes into the user's shell start-up files",
}
# The first word of a line that is no curl or casque command: why it is not run.
OTHER_PROGRAMS = {
    "kubectl": "needs a Kubernetes cluster", "helm": "needs a Kubernetes cluster",
    "kind": "makes a Kubernetes cluster", "docker": "builds images", "podman": "builds images",
    "java": "openapi-generator (test_generated_client.py runs a client made so)",
    "spark-submit": "needs Spark on Kubernetes", "pip": "installs packages", "bash": "an installer script",
    "python": "the test suite and benchmarks", "export": "settings for spark-submit",
    "--range": "options of `casque spark`, shown alone", "[--liveness": "the synopsis of `casque operator run`",
    "[--no-leader-election": "the synopsis of `casque operator run`",
    "[--metrics-port": "the synopsis of `casque operator run`",
}
SETTING = re.compile(r"^[A-Z_]+=")  # a line of settings (an env file), no command
# Commands that run until stopped: started, awaited until they print, then interrupted (Ctrl-C).
UNTIL_STOPPED = ("casque tail ", "casque stats orders --watch")
RECEIPT = re.compile(r'"(?:([A-Z]{4})' + ELLIPSIS + "|" + ELLIPSIS + ')"')
MESSAGE_ID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}\b")
SCRATCH_PATH = re.compile(r"(?<=\s)/(backups|tmp)/")
# Answer fields whose values are the stack's own (places in the log, times, ids).
VARYING = frozenset({"messageId", "shard", "batch", "seq", "time", "publishedat", "visibleuntil", "receipt", "id",
                     "messageid", "deliverAt"})

ORDERS = """\
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {name: orders}
spec: {shards: 4, priorities: 2, retention: 3650d}
---
apiVersion: casque.io/v1alpha1
kind: Subscriber
metadata: {name: billing}
spec: {queue: orders, startPosition: earliest}
---
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {name: invoices}
spec: {shards: 1}
"""
BILLING_IN_SHOP = """\
---
apiVersion: casque.io/v1alpha1
kind: Subscriber
metadata: {name: billing, namespace: shop}
spec: {queue: orders, startPosition: earliest}
"""
# The queues each document's examples use: its own YAML where it shows some (with what its
# commands name and it does not define), else orders (4 shards, 2 priorities, the longest
# retention, so that the documents' dates stay within it), its subscriber billing, and invoices.
WORLDS: dict[str, Callable[[], str]] = {
    "docs/filters.md": lambda: yaml_blocks(ROOT / "docs" / "filters.md")[0],
    "docs/schemas.md": lambda: yaml_blocks(ROOT / "docs" / "schemas.md")[0] + BILLING_IN_SHOP,
    "docs/operator.md": lambda: yaml_blocks(ROOT / "docs" / "operator.md")[0],
}
MESSAGES_JSONL = '{"data": {"order": 43}, "partitionkey": "customer-8"}\n{"data": {"order": 44}}\n'


def allowed(example: Example) -> str | None:
    """Why the example is not run, or None when it is."""
    for (doc, start), reason in ALLOW_LIST.items():
        if example.doc == doc and example.command.startswith(start):
            return reason
    return None


def runnable(example: Example) -> bool:
    return example.words[0] in ("curl", "casque", ".venv/bin/casque") and allowed(example) is None


def documents_with_examples() -> list[str]:
    return [str(doc.relative_to(ROOT)) for doc in DOCS if any(runnable(e) for e in examples(doc))]


@dataclass
class Reading:
    """One document's run: what it has published and handed out so far."""

    sidecar: SidecarProcess | None
    work: Path
    env: dict[str, str]
    empty_backends: Callable[[], None]
    apply_world: Callable[[], None]
    message_ids: list[str] = field(default_factory=list)
    receipts: list[str] = field(default_factory=list)
    last_receive: str = ""
    named: dict[tuple[int, str], str] = field(default_factory=dict)

    def address(self) -> str:
        assert self.sidecar is not None, "a curl example in a document whose examples start no sidecar"
        return self.sidecar.url.removeprefix("http://")

    def rewrite(self, example: Example) -> str:
        """The command with the test's address, receipts, message ids and paths."""
        command = example.command.replace(".venv/bin/casque ", "casque ")
        if example.words[0] == "curl":
            command = command.replace(DOC_ADDRESS, self.address()).replace(" .../", f" {self.last_receive}/")
            if re.search(r"/(ack|nack|extend) ", command):
                command = RECEIPT.sub(lambda m: json.dumps(self.receipt(example.block, m.group(1))), command)
        if MESSAGE_ID.search(command):
            command = MESSAGE_ID.sub(self.message_id(), command)
        # A block's own: two blocks may be two ways to the same end (deploy.md's image contexts).
        return SCRATCH_PATH.sub(lambda m: f"{self.work}/{example.block}/{m.group(1)}/", command)

    def receipt(self, block: int, name: str | None) -> str:
        if name is not None and (block, name) in self.named:
            return self.named[(block, name)]
        if not self.receipts:
            self.receipts.extend(self.receive_more())
        fresh = self.receipts.pop(0)
        if name is not None:
            self.named[(block, name)] = fresh
        return fresh

    def receive_more(self) -> list[str]:
        """A receipt when the document's receives gave fewer than its placeholders use: one
        message published and received, as the app's own traffic would be."""
        queue_url = "http://" + self.last_receive.split("/subscribers/")[0]
        call(f"{queue_url}/messages", {"data": {"stand-in": True}})
        answer = call(f"http://{self.last_receive}/receive", {"max": 1, "wait": 20})
        assert answer["messages"], "no message to take a receipt from"
        return [m["receipt"] for m in answer["messages"]]

    def message_id(self) -> str:
        if not self.message_ids:  # a document that traces a message it did not publish
            done = shell(["casque", "publish", "orders", '{"order": 1}', "-o", "json"], self)
            assert done.returncode == 0, done.stderr
            self.message_ids.append(json.loads(done.stdout)["results"][0]["messageId"])
        return self.message_ids[0]

    def note(self, command: str, body: str) -> None:
        """Take what later commands use from an answer: message ids, receipts, the receive's path."""
        try:
            answer = json.loads(body)
        except ValueError:
            return
        if isinstance(answer, dict) and "messageId" in answer:
            self.message_ids.append(answer["messageId"])
        if "/receive" in command and isinstance(answer, dict):
            self.receipts.extend(m["receipt"] for m in answer.get("messages", []))
            found = re.search(r"(\S+)/receive", command)
            assert found
            self.last_receive = found.group(1)


def call(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def shell(command: str | list[str], reading: Reading) -> subprocess.CompletedProcess[str]:
    """Run a command as a reader's shell would, in the scratch directory."""
    argv = ["bash", "-c", command] if isinstance(command, str) else command
    return subprocess.run(argv, cwd=reading.work, env=reading.env, capture_output=True, text=True, timeout=300,
                          check=False)


def run_example(example: Example, reading: Reading) -> None:
    command = reading.rewrite(example)
    if example.words[:2] == ["casque", "restore"]:
        reading.empty_backends()  # the document restores into empty backends
    if example.command.startswith(UNTIL_STOPPED):
        run_until_stopped(command, reading)
        return
    if example.words[0] == "curl":
        reading.note(command, run_curl(example, command, reading))
        return
    done = shell(command, reading)
    context = f"{example.where}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    if example.shown.startswith("casque: "):  # a refusal the document shows: one line, exit 1
        assert done.returncode == 1 and done.stderr.strip() == example.shown, context
    else:
        assert done.returncode == 0, context
    if example.words[:2] == ["casque", "restore"]:
        reading.apply_world()  # then the queues are applied again, as the operator does


def run_curl(example: Example, command: str, reading: Reading) -> str:
    """Run a curl example and check its status and, where the document prints one, its answer; the body.

    A read (a GET) whose answer the document prints is asked again until it answers so: its
    figures (a stats count) follow what the sidecar's readers have done, which a reader who
    types the commands gives them time for."""
    shown = Template(example.shown, VARYING) if example.shown else None
    error = shown is not None and isinstance(shown.pattern, dict) and "error" in shown.pattern
    read_only = not {"-d", "--data", "--data-binary", "-X"} & set(example.words)
    last: list[str] = []

    def answered() -> tuple[str] | None:  # a tuple: an empty body (a redirected one) is an answer too
        done = shell(command, reading)
        context = f"{example.where}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert done.returncode == 0, context
        status = int(done.stderr[-3:])  # the curl wrapper writes the HTTP status last, to stderr
        assert (400 <= status < 500) if error else (200 <= status < 300), (status, context)
        problem = shown.mismatch(json.loads(done.stdout)) if shown is not None else None
        last[:] = [f"{problem}\n{context}"]
        assert problem is None or read_only, last[0]
        stats = re.search(r"(\S+/subscribers/[\w-]+)/stats", command)
        if problem is not None and stats:
            # A filtered message is passed over (and counted) when a receive reaches it, not
            # when it is loaded (filters.md): a reader's receive came long after the loading, so
            # the test's reaches it meanwhile. It may hand out nothing the document has not shown.
            handed = call(f"http://{stats.group(1)}/receive", {"max": 10})["messages"]
            assert not handed, f"{example.where}: a receive after the document's handed out {handed}"
        return (done.stdout,) if problem is None else None

    try:
        return wait_for(f"{example.where} to answer as printed", answered, timeout=60)[0]
    except pytest.fail.Exception:
        pytest.fail(last[0])


def run_until_stopped(command: str, reading: Reading) -> None:
    """Start a command that runs until Ctrl-C in a terminal of its own (as a reader does: a
    table that refreshes draws only on one), wait until it prints, then interrupt it."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=reading.work, env=reading.env,
                               stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    printed = bytearray()

    def more() -> bool:
        while select.select([primary], [], [], 0)[0]:
            try:
                printed.extend(os.read(primary, 65536))
            except OSError:  # the command ended and closed the terminal
                break
        return process.poll() is not None or bool(printed.strip())

    try:
        wait_for(f"{command} to print", more, timeout=120)
        assert process.poll() is None, f"{command}: ended ({process.returncode}) when it should run on: {printed!r}"
        process.send_signal(signal.SIGINT)
        assert process.wait(60) in (0, 130), f"{command}: {printed!r}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        os.close(primary)


def tools(directory: Path) -> Path:
    """`casque` (this checkout's) and `curl` (writing the HTTP status to stderr) as a reader runs them."""
    directory.mkdir()
    found = shutil.which("curl")
    if found is None:
        unavailable("curl is not installed (apt-get install curl)")
    (directory / "casque").write_text(f'#!/bin/sh\nexec {sys.executable} -m casque.cli "$@"\n')
    status_last = "--write-out '%{stderr}%{http_code}'"
    (directory / "curl").write_text(f'#!/bin/sh\nexec {found} --max-time 60 {status_last} "$@"\n')
    for tool in directory.iterdir():
        tool.chmod(0o755)
    return directory


def memory_snapshots(work: Path) -> None:
    """Two allocation snapshots of this process, for `casque memory-growth` to compare."""
    tracemalloc.start(5)
    try:
        tracemalloc.take_snapshot().dump(str(work / "before.tracemalloc"))
        kept = [bytes(1000) for _ in range(1000)]
        tracemalloc.take_snapshot().dump(str(work / "after.tracemalloc"))
        del kept
    finally:
        tracemalloc.stop()


def test_every_shell_line_of_the_docs_is_run_or_said_why_not() -> None:
    unknown = [e.where for doc in DOCS for e in examples(doc)
               if not runnable(e) and allowed(e) is None and e.words[0] not in OTHER_PROGRAMS
               and not SETTING.match(e.command)]
    assert not unknown, f"run these in test_doc_examples.py, or say in ALLOW_LIST why not: {unknown}"
    assert len(documents_with_examples()) >= 6


@pytest.mark.parametrize("doc", documents_with_examples())
def test_the_doc_examples_work_as_printed(
    doc: str, store: Store, backends: Backends, keyspace: str, zk_hosts: str, tmp_path: Path,
    start_sidecar: Callable[..., SidecarProcess],
) -> None:
    chosen = [e for e in examples(ROOT / doc) if runnable(e)]
    work = tmp_path / "work"
    work.mkdir()
    world = WORLDS.get(doc, lambda: ORDERS)()
    (work / "queues.yaml").write_text(world)
    (work / "messages.jsonl").write_text(MESSAGES_JSONL)
    if any(".tracemalloc" in e.command for e in chosen):
        memory_snapshots(work)
    bin_dir = tools(tmp_path / "bin")
    env = {**os.environ, **backends.client_env(keyspace, zk_hosts, store.zk_root),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def empty_backends() -> None:
        drop_keyspace(store.session, keyspace)
        store.zk.delete(store.zk_root, recursive=True)

    def apply_world() -> None:
        done = subprocess.run(["casque", "apply", "-f", "queues.yaml"], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stdout + done.stderr

    apply_world()
    reading = Reading(None, work, env, empty_backends, apply_world)
    if any(e.words[0] == "curl" for e in chosen):
        reading.sidecar = start_sidecar(*sidecar_flags(chosen, world))
    for example in chosen:
        if example.words[:2] == ["casque", "sidecar"]:
            continue  # the sidecar the test started, with these flags
        run_example(example, reading)


def sidecar_flags(chosen: list[Example], world: str) -> list[str]:
    """The document's own `casque sidecar` flags, else its queue's and the subscribers it receives for."""
    for example in chosen:
        if example.words[:2] == ["casque", "sidecar"]:
            return example.words[2:]
    namespace = "shop" if "namespace: shop" in world else "default"
    subscribers = sorted({m.group(1) for e in chosen for m in re.finditer(r"/subscribers/([\w-]+)/receive", e.command)})
    return ["--namespace", namespace, "--queue", "orders", *(f"--subscriber={name}" for name in subscribers)]
