"""The images, built from the Dockerfiles and run with podman against the session's servers.

The sidecar's container serves the API on the test's Cassandra and ZooKeeper; the operator's
container reconciles a Queue from the test's kube-apiserver. Both run as the image's user
(10001) on a read-only root filesystem with only /tmp writable, as the chart runs them.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from casque.devstack.kube import KubeCluster
from casque.engine import catalog
from casque.operator.resources import QUEUES
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.images import Images, hardened, podman, remove_container
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import reserved_port, wait_for
from tests.integration.test_operator import (  # noqa: F401
    Backend,
    _remaining,
    _strip_finalizers,
    backend,
    casque_crds,
    create,
    delete,
    queue,
    ready_of,
    table_ttl,
    wait_ready,
)

pytestmark = pytest.mark.integration

QUEUE = "jobs"
SUBSCRIBER = "workers"
IMAGE_USER = 10001


class Containers:
    """Containers started in the foreground (`podman run --rm`), their output in a file each;
    removed at the end whatever became of them."""

    def __init__(self, built: Images, tmp_path: Path) -> None:
        self.images = built
        self.tmp_path = tmp_path
        self.names: list[str] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.numbers = itertools.count()

    def start(self, image: str, *args: str, options: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], Path, str]:
        name = f"casque-test-{self.images.session}-{next(self.numbers)}"
        log = self.tmp_path / f"{name}.log"
        run = hardened(image, name)
        command = ["podman", *run[:-1], *options, run[-1], *args]
        self.names.append(name)
        with log.open("wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process, log, name

    def close(self) -> None:
        for name in self.names:
            remove_container(name)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


@pytest.fixture
def containers(images: Images, tmp_path: Path) -> Iterator[Containers]:  # noqa: F811
    started = Containers(images, tmp_path)
    try:
        yield started
    finally:
        started.close()


def env_options(env: dict[str, str]) -> tuple[str, ...]:
    return tuple(itertools.chain.from_iterable(("--env", f"{k}={v}") for k, v in env.items()))


# --- the image itself -----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["sidecar", "operator"])
def test_the_image_runs_as_its_user_without_pip_and_cannot_write_outside_tmp(images: Images, which: str) -> None:  # noqa: F811
    image = getattr(images, which)
    config = podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    assert config == f"{IMAGE_USER}:{IMAGE_USER}"
    probe = (
        "import os, pathlib\n"
        "print(os.getuid(), os.getgid())\n"
        "pathlib.Path('/tmp/ok').write_text('x')\n"
        "for path in ('/opt/casque/x', '/x'):\n"
        "    try:\n"
        "        pathlib.Path(path).write_text('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as error:\n"
        "        print('refused', path, error.errno)\n"
        "import casque, casque.sidecar.server, casque.operator.main, casque_client\n"
        "print('imports', casque.__file__)\n"
        "import importlib.util\n"
        "print('pip', importlib.util.find_spec('pip') is not None, os.path.exists('/opt/casque/bin/pip'))\n"
        "print('tracing', importlib.util.find_spec('opentelemetry') is not None)\n"
        "if importlib.util.find_spec('opentelemetry') is not None:\n"
        "    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter\n"
        "    from opentelemetry.sdk.trace import TracerProvider\n"
        "    print('exporter', OTLPSpanExporter.__name__)\n"
    )
    name = f"casque-test-{images.session}-probe-{which}"
    run = hardened(image, name)
    try:
        result = podman(*run[:-1], "--entrypoint", "python3", run[-1], "-c", probe)
    finally:
        remove_container(name)
    lines = result.stdout.splitlines()
    assert lines[0] == f"{IMAGE_USER} {IMAGE_USER}"
    # EROFS (30): the root filesystem is read-only; nothing but /tmp takes a write.
    assert lines[1:3] == ["refused /opt/casque/x 30", "refused /x 30"]
    assert lines[3].startswith("imports /opt/casque/lib/python3.11/site-packages/casque/")
    assert lines[4] == "pip False False"  # casque's virtualenv carries no installer
    # The sidecar carries the tracing extra (off until an OTLP endpoint is set); the operator does not.
    if which == "sidecar":
        assert lines[5:] == ["tracing True", "exporter OTLPSpanExporter"]
    else:
        assert lines[5:] == ["tracing False"]


# --- the sidecar's container serves the API -------------------------------------------------


async def test_the_sidecar_container_serves_the_queue(
    containers: Containers, store: Store, backends: Backends, keyspace: str, zk_hosts: str
) -> None:
    ref = QueueRef("default", QUEUE)
    catalog.apply_queue(store, ref, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE",
                                              max_message_bytes=4096))
    catalog.apply_subscriber(store, ref, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=30))
    env = backends.client_env(keyspace, zk_hosts, store.zk_root)
    # Port 0: the sidecar binds a free port and logs its address, which SidecarProcess reads.
    process, log, _ = containers.start(
        containers.images.sidecar, "sidecar", "--port", "0", "--queue", QUEUE, "--subscriber", SUBSCRIBER,
        options=env_options(env),
    )
    sidecar = SidecarProcess(process, log)
    sidecar.wait_ready(limit_s=120)
    assert sidecar.url.startswith("http://127.0.0.1:")

    async with AsyncClient(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as app:
        published = await app.publish_batch([{"data": {"n": i}} for i in range(5)])
        got: dict[str, object] = {}
        while len(got) < len(published):
            messages = await app.receive(max=10, wait=5)
            outcomes = await app.ack_batch([m.receipt for m in messages]) if messages else []
            assert all(o.status == "acked" for o in outcomes)
            got.update((m.message_id, m.data) for m in messages)
    assert set(got) == {r.message_id for r in published}
    assert sorted(d["n"] for d in got.values()) == list(range(5))  # type: ignore[index]
    assert sidecar.alive
    assert "Traceback" not in log.read_text(errors="replace")


# --- the operator's container reconciles ----------------------------------------------------


@pytest.fixture
def operator_container(
    containers: Containers,
    backend: Backend,  # noqa: F811
    kube_cluster: KubeCluster,  # noqa: F811
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
    casque_crds: None,  # noqa: F811
    tmp_path: Path,
) -> Iterator[Callable[[], str]]:
    """Start the operator's container for the test's namespace; at the end, delete the
    namespace's resources while it still runs, so their finalizers are released."""
    # The kubeconfig (server on 127.0.0.1, token and CA inline) mounted read-only, readable by
    # the image's user.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_bytes(kube_cluster.kubeconfig_path.read_bytes())
    kubeconfig.chmod(0o644)
    port = reserved_port()
    env = {k: v for k, v in backend.env.items() if k.startswith("CASQUE_")}
    env["KUBECONFIG"] = "/etc/casque/kubeconfig"
    started: list[subprocess.Popen[bytes]] = []

    def start() -> str:
        process, log, _ = containers.start(
            containers.images.operator,
            "operator", "run", "--namespace", kube_namespace, "--lease-namespace", kube_namespace,
            "--liveness", f"http://127.0.0.1:{port}/healthz",
            options=(*env_options(env), "--volume", f"{kubeconfig}:/etc/casque/kubeconfig:ro"),
        )
        started.append(process)
        return str(log)

    try:
        yield start
    finally:
        api = client.CustomObjectsApi(kube_client)
        for name in [n for n in _remaining(api, kube_namespace)]:
            delete(api, kube_namespace, QUEUES, name)
        try:
            if any(p.poll() is None for p in started):
                wait_for("the test's resources to be deleted", lambda: not _remaining(api, kube_namespace), timeout=120)
        finally:
            _strip_finalizers(api, kube_namespace)


def test_the_operator_container_reconciles_a_queue(
    operator_container: Callable[[], str],
    backend: Backend,  # noqa: F811
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    log = Path(operator_container())
    create(api, kube_namespace, queue("orders", shards=2, retention="1h", deletionPolicy="Delete"))
    try:
        ready = wait_ready(api, kube_namespace, QUEUES, "orders", timeout=120)
    except BaseException:
        print(log.read_text(errors="replace")[-6000:])
        raise
    assert ready_of(ready)["reason"] == "Reconciled"
    ref = QueueRef(kube_namespace, "orders")
    assert catalog.read_queue(backend.store, ref).spec.shards == 2
    assert table_ttl(backend, "orders", kube_namespace) == 3600
