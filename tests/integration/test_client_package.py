"""casque-client installed alone into a fresh virtualenv, and the example worker run from it.

The venv gets `pip install ./client` and nothing else (pip reaches the index through its
cache), so an import of casque's server-side packages there would fail: the client must
work without them. The example worker (examples/worker/worker.py) then consumes from a real
`casque sidecar` process with that venv's Python.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import Client, message
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "orders"
SUBSCRIBER = "billing"
SERVER_SIDE = ("casque", "cassandra", "kazoo", "kopf", "kubernetes", "typer", "pydantic")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would let the venv see this checkout's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("client-alone")
    # Built from a copy, so the build leaves nothing (build/, *.egg-info) in the checkout.
    source = work / "client"
    shutil.copytree(ROOT / "client", source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", str(source)],
        capture_output=True, text=True, timeout=900, cwd=work, env=clean_env(), check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


def test_the_client_installs_and_imports_without_casque_server_packages(client_python: Path) -> None:
    probe = (
        "import importlib.util, json, casque_client\n"
        "from casque_client import AsyncClient, Client, subscribe\n"
        f"print(json.dumps({{'file': casque_client.__file__, 'present': [m for m in {SERVER_SIDE!r} "
        "if importlib.util.find_spec(m)]}))\n"
    )
    result = subprocess.run([str(client_python), "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=client_python.parent, env=clean_env(), check=False)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["present"] == []
    assert found["file"].startswith(str(client_python.parents[1]))  # the venv's copy, not the checkout's
    listed = subprocess.run([str(client_python), "-m", "pip", "list", "--format=json"], capture_output=True,
                            text=True, timeout=120, env=clean_env(), check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "casque-client" in names and "aiohttp" in names
    assert not names & {"casque", "cassandra-driver", "kazoo", "kopf"}


def test_the_example_worker_consumes_with_the_client_alone(
    client_python: Path, store: Store, start_sidecar: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    ref = QueueRef("default", QUEUE)
    catalog.apply_queue(store, ref, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, ref, SUBSCRIBER, SubscriberSpec(queue=QUEUE, start_position="earliest"))
    sidecar = start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER)
    with Client(sidecar.url, queue=QUEUE) as client:
        published = {r.message_id for r in client.publish_batch([message({"order": n}) for n in range(20)])}

    # The variables the injection webhook gives an app container, and nothing else of casque's.
    env = clean_env(CASQUE_SIDECAR_URL=sidecar.url, CASQUE_SIDECAR_QUEUE=QUEUE,
                    CASQUE_SIDECAR_SUBSCRIBERS=SUBSCRIBER, WORKER_CONCURRENCY="4")
    log = tmp_path / "worker.log"
    with log.open("wb") as sink:
        worker = subprocess.Popen([str(client_python), str(ROOT / "examples" / "worker" / "worker.py")],
                                  env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        def all_billed() -> bool:
            assert worker.poll() is None, log.read_text()
            billed = {line.split("(message ")[1].split(",")[0] for line in log.read_text().splitlines()
                      if line.startswith("billed order")}
            return billed == published

        wait_for("the worker to bill every order", all_billed, timeout=120)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=120) == 0, log.read_text()
        assert "worker stopped" in log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
    # Each handled message was acked: nothing is left for the subscriber.
    with Client(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        assert client.receive(max=100) == []
