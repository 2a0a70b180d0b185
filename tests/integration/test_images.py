"""The images, built from the Dockerfiles and run with podman against the session's servers.

The sidecar's container serves the API on the test's Cassandra and ZooKeeper; the operator's
container reconciles a Queue from the test's kube-apiserver. Both run as the image's user
(10001) on a read-only root filesystem with only /tmp writable, as the chart runs them. The
backends' images (casque-zookeeper, casque-cassandra) run the same way, with only their data
and log volumes writable besides /tmp: ZooKeeper serves a client, Cassandra (in 2 GiB) refuses
clients without a login, takes the installation's login in place of its default superuser
(`secure_cassandra`), then a keyspace and a table, and stops cleanly on `podman stop`. Three
ZooKeeper containers form an ensemble, and three Cassandra containers on a podman network of
their own form a ring, secured with system_auth on every node, that still reads at QUORUM and
takes the installation's login with one node stopped.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import secrets
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from pydantic import SecretStr

from casque.backends.cql import connect
from casque.backends.superuser import DEFAULT_PASSWORD, DEFAULT_SUPERUSER, Secured, secure_cassandra
from casque.backends import zk
from casque.config import CassandraTlsSettings, ReplicationSettings, Settings, ZooKeeperTlsSettings
from casque.devstack.backend_images import IMAGE_MAX_CLIENT_CONNECTIONS
from casque.devstack.jvm import C1_ONLY_OPTIONS
from casque.devstack.pki import issue_cert, make_ca
from casque.errors import AccessDenied
from casque.devstack.kube import KubeCluster
from casque.engine import catalog
from casque.operator.resources import QUEUES
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.images import BackendImages, Images, hardened, podman, remove_container
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

    def __init__(self, built: Images | BackendImages, tmp_path: Path) -> None:
        self.images = built
        self.tmp_path = tmp_path
        self.names: list[str] = []
        self.networks: list[str] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.numbers = itertools.count()

    def name(self) -> str:
        """A name for the next container, never used before in this session."""
        return f"casque-test-{self.images.session}-{next(self.numbers)}"

    def network(self) -> str:
        """A podman network of its own, removed after the containers."""
        name = f"{self.name()}-net"
        podman("network", "create", name)
        self.networks.append(name)
        return name

    def start(self, image: str, *args: str, options: tuple[str, ...] = (), name: str | None = None,
              network: str = "host") -> tuple[subprocess.Popen[bytes], Path, str]:
        name = name or self.name()
        log = self.tmp_path / f"{name}.log"
        if isinstance(self.images, BackendImages):
            # A backend here lives for a test: its JVM compiles with C1 only, as the suite's
            # own servers do (casque.devstack.jvm); a later --env in `options` overrides it.
            options = ("--env", f"JAVA_TOOL_OPTIONS={C1_ONLY_OPTIONS}", *options)
        run = hardened(image, name, network)
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
        for network in self.networks:
            podman("network", "rm", "--force", network, check=False)


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


# --- the backends' images -------------------------------------------------------------------


@pytest.fixture
def backend_containers(backend_images: BackendImages, tmp_path: Path) -> Iterator[Containers]:
    started = Containers(backend_images, tmp_path)
    try:
        yield started
    finally:
        started.close()


@pytest.mark.parametrize(("which", "volumes"), [
    ("zookeeper", {"/data", "/logs", "/tmp"}),
    ("cassandra", {"/var/lib/cassandra", "/var/log/cassandra", "/tmp"}),
])
def test_the_backend_image_runs_as_its_user_with_its_volumes(backend_images: BackendImages, which: str,
                                                             volumes: set[str]) -> None:
    image = getattr(backend_images, which)
    user = podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    assert user == f"{IMAGE_USER}:{IMAGE_USER}"
    declared = podman("image", "inspect", "--format", "{{range $k, $v := .Config.Volumes}}{{$k}} {{end}}", image)
    assert set(declared.stdout.split()) == volumes


def assert_round_trip(client: Any, path: str) -> None:
    """Start `client` (a KazooClient), write `path` and read it back; stop it whatever happens."""
    client.start(timeout=30)
    try:
        client.create(path, b"hello", makepath=True)
        assert client.get(path)[0] == b"hello"
    finally:
        client.stop()
        client.close()


def test_the_zookeeper_container_serves_a_client(backend_containers: Containers) -> None:
    from kazoo.client import KazooClient

    port = reserved_port()
    process, log, name = backend_containers.start(
        backend_containers.images.zookeeper,  # type: ignore[union-attr]
        options=env_options({"ZOO_CLIENT_PORT": str(port), "ZOO_HEAP_MB": "128"}),
    )

    def serving() -> bool:
        if process.poll() is not None:
            pytest.fail(f"the ZooKeeper container exited {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        return podman("exec", name, "/opt/zookeeper/bin/serving", check=False).returncode == 0

    wait_for("ZooKeeper's `serving` to succeed", serving, timeout=120)
    # One address holds at most 60 connections (a pod's flood): the 61st client is not served.
    flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(IMAGE_MAX_CLIENT_CONNECTIONS)]
    try:
        wait_for("a client past the cap to be refused", lambda: not session_opens(port), timeout=60)
    finally:
        for connection in flood:
            connection.close()
    assert_round_trip(KazooClient(hosts=f"127.0.0.1:{port}", timeout=10.0), "/casque-image/probe")
    # The data went to the data volume, the log to the log volume; nothing else was writable.
    listing = podman("exec", name, "bash", "-c", "ls /data /logs; touch /opt/zookeeper/x 2>&1; id -u", check=False)
    assert "version-2" in listing.stdout and "zookeeper.log" in listing.stdout
    assert "Read-only file system" in listing.stdout
    assert listing.stdout.split()[-1] == str(IMAGE_USER)


def session_opens(port: int) -> bool:
    """Whether a ZooKeeper session opens on 127.0.0.1:`port` within a few seconds."""
    from kazoo.client import KazooClient
    from kazoo.handlers.threading import KazooTimeoutError

    client = KazooClient(hosts=f"127.0.0.1:{port}", timeout=3.0, connection_retry={"max_tries": 0})
    try:
        client.start(timeout=3.0)
    except KazooTimeoutError:
        return False
    finally:
        client.stop()
        client.close()
    return True


def tls_secret(tmp_path: Path, hosts: list[str]) -> Path:
    """tls.crt, tls.key and ca.crt, as the chart's Secret of a backend mounts them (readable by
    the image's user)."""
    pki = tmp_path / "pki"
    ca_crt, ca_key = make_ca(pki)
    crt, key = issue_cert(pki, ca_crt, ca_key, "backend", hosts)
    mounted = tmp_path / "tls"
    mounted.mkdir()
    for source, name in ((crt, "tls.crt"), (key, "tls.key"), (ca_crt, "ca.crt")):
        (mounted / name).write_bytes(source.read_bytes())
        (mounted / name).chmod(0o644)
    return mounted


def container_address(name: str) -> str:
    """The address of a container on its podman network."""
    inspected = podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name)
    return inspected.stdout.strip()


def refused(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


def test_the_backend_containers_serve_tls_only_from_a_secrets_pem_files_and_cassandra_takes_up_a_renewal(
    backend_containers: Containers, tmp_path: Path,
) -> None:
    """As the chart runs them with backends.tls: the Secret's PEM files mounted, and
    CASSANDRA_TLS_DIR and ZOO_TLS_DIR naming them. A client that trusts the CA and checks the
    name reaches both; the plain ports refuse (ZooKeeper's plain port serves its own loopback,
    for the readiness probe, which still answers). Then the certificate is renewed in the
    Secret: Cassandra serves the new one to new clients without a restart (it used to look at
    its stores only every ten minutes, and at stores made once at start, so never), and a
    session connected before goes on."""
    from cassandra.cluster import Cluster, NoHostAvailable
    from kazoo.client import KazooClient

    name = "casque-backends.test"
    pem = tls_secret(tmp_path, [name])
    network = backend_containers.network()
    mount = ("--volume", f"{pem}:/etc/casque-tls:ro")
    zookeeper, zookeeper_log, zookeeper_name = backend_containers.start(
        backend_containers.images.zookeeper,  # type: ignore[union-attr]
        network=network, options=(*env_options({"ZOO_TLS_DIR": "/etc/casque-tls", "ZOO_HEAP_MB": "128"}), *mount))
    cassandra, cassandra_log, cassandra_name = backend_containers.start(
        backend_containers.images.cassandra,  # type: ignore[union-attr]
        network=network, options=(*env_options({"CASSANDRA_TLS_DIR": "/etc/casque-tls",
                                                "CASSANDRA_AUTHENTICATOR": "AllowAllAuthenticator",
                                                "CASSANDRA_AUTHORIZER": "AllowAllAuthorizer",
                                                "TLS_CHECK_SECONDS": "1"}),
                                  *mount, "--memory", RING_MEMORY))

    def serving() -> bool:
        if zookeeper.poll() is not None:
            pytest.fail(f"the ZooKeeper container exited {zookeeper.returncode}:\n"
                        f"{zookeeper_log.read_text(errors='replace')[-4000:]}")
        return podman("exec", zookeeper_name, "/opt/zookeeper/bin/serving", check=False).returncode == 0

    wait_for("ZooKeeper's `serving` to succeed", serving, timeout=120)
    zookeeper_address = container_address(zookeeper_name)
    tls = zk.tls_options(Settings(zookeeper_tls=ZooKeeperTlsSettings(enabled=True, ca_file=pem / "ca.crt",
                                                                    verify_hostname=False)))
    assert_round_trip(KazooClient(hosts=f"{zookeeper_address}:2281", timeout=10.0, **tls), "/casque-image/over-tls")
    assert refused(zookeeper_address, 2181)

    def cql_listening() -> bool:
        if cassandra.poll() is not None:
            pytest.fail(f"the Cassandra container exited {cassandra.returncode}:\n"
                        f"{cassandra_log.read_text(errors='replace')[-4000:]}")
        # Cassandra logs this line just before its port is bound: the port is asked too.
        if "Starting listening for CQL clients" not in cassandra_log.read_text(errors="replace"):
            return False
        try:
            socket.create_connection((container_address(cassandra_name), 9042), timeout=10).close()
        except OSError:
            return False
        return True

    wait_for("Cassandra to listen for CQL", cql_listening, timeout=300)
    assert "CQL over TLS only" in cassandra_log.read_text(errors="replace")
    cassandra_address = container_address(cassandra_name)
    settings = Settings(cassandra_contact_points=[cassandra_address], cassandra_local_dc="dc1",
                        cassandra_tls=CassandraTlsSettings(enabled=True, ca_file=pem / "ca.crt", server_hostname=name))
    cluster, session = connect(settings)
    try:
        assert session.execute("SELECT cluster_name FROM system.local").one().cluster_name == "casque"
        first = ssl.PEM_cert_to_DER_cert((pem / "tls.crt").read_text())
        assert served_certificate(cassandra_address, 9042, pem) == first
        renewed = renew(tmp_path, pem, name)
        wait_for("Cassandra to serve the renewed certificate",
                 lambda: served_certificate(cassandra_address, 9042, pem) == renewed, timeout=120)
        renewal_reported(cassandra_log)
        assert cassandra.poll() is None  # no restart
        assert session.execute("SELECT cluster_name FROM system.local").one().cluster_name == "casque"
    finally:
        cluster.shutdown()
    renewed_cluster, _ = connect(settings)  # a new client checks the renewed certificate's name too
    renewed_cluster.shutdown()
    # In plain text the node answers nothing a driver understands.
    plain = Cluster([cassandra_address], connect_timeout=5)
    with pytest.raises(NoHostAvailable):
        plain.connect()
    plain.shutdown()
    # Nor does a client that checks for another name.
    with pytest.raises(Exception, match="(?i)hostname|certificate"):
        connect(settings.model_copy(update={"cassandra_tls": CassandraTlsSettings(
            enabled=True, ca_file=pem / "ca.crt", server_hostname="elsewhere.test")}))


def test_the_zookeeper_container_takes_up_a_renewed_certificate_without_a_restart(
    backend_containers: Containers, tmp_path: Path,
) -> None:
    """cert-manager renews the backends' certificates in their Secret, and Kubernetes updates
    the mounted files in place. Before, the container made its stores once, at start: it went
    on serving the old certificate until its pod restarted, past that certificate's expiry if
    nobody restarted it. Now it makes new stores when the files change, and ZooKeeper reads
    them: a new client meets the renewed certificate, and a client connected before goes on."""
    from kazoo.client import KazooClient

    name = "casque-zookeeper.test"
    pem = tls_secret(tmp_path, [name])
    zookeeper, log, zookeeper_name = backend_containers.start(
        backend_containers.images.zookeeper,  # type: ignore[union-attr]
        network=backend_containers.network(),
        options=(*env_options({"ZOO_TLS_DIR": "/etc/casque-tls", "ZOO_HEAP_MB": "128", "TLS_CHECK_SECONDS": "1"}),
                 "--volume", f"{pem}:/etc/casque-tls:ro"))

    def serving() -> bool:
        if zookeeper.poll() is not None:
            pytest.fail(f"the ZooKeeper container exited {zookeeper.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        return podman("exec", zookeeper_name, "/opt/zookeeper/bin/serving", check=False).returncode == 0

    wait_for("ZooKeeper's `serving` to succeed", serving, timeout=120)
    address = container_address(zookeeper_name)
    first = ssl.PEM_cert_to_DER_cert((pem / "tls.crt").read_text())
    assert served_certificate(address, 2281, pem) == first
    tls = zk.tls_options(Settings(zookeeper_tls=ZooKeeperTlsSettings(enabled=True, ca_file=pem / "ca.crt",
                                                                    verify_hostname=False)))
    before = KazooClient(hosts=f"{address}:2281", timeout=10.0, **tls)
    before.start(timeout=30)
    try:
        before.create("/casque-image/renewal", b"before", makepath=True)
        renewed = renew(tmp_path, pem, name)
        assert renewed != first
        wait_for("ZooKeeper to serve the renewed certificate",
                 lambda: served_certificate(address, 2281, pem) == renewed, timeout=120)
        renewal_reported(log)
        assert zookeeper.poll() is None  # no restart
        assert_round_trip(KazooClient(hosts=f"{address}:2281", timeout=10.0, **tls), "/casque-image/after-renewal")
        assert before.get("/casque-image/renewal")[0] == b"before"
    finally:
        before.stop()
        before.close()


def renew(tmp_path: Path, pem: Path, name: str) -> bytes:
    """A new key and certificate from the Secret's CA, written into its directory as the
    kubelet updates a mounted Secret; the new certificate (DER)."""
    crt, key = issue_cert(tmp_path / "pki", tmp_path / "pki" / "ca.crt", tmp_path / "pki" / "ca.key", "renewed", [name])
    for source, target in ((key, "tls.key"), (crt, "tls.crt")):
        staged = pem / f".{target}.new"
        staged.write_bytes(source.read_bytes())
        staged.chmod(0o644)
        staged.replace(pem / target)
    return ssl.PEM_cert_to_DER_cert(crt.read_text())


def renewal_reported(log: Path) -> None:
    """The image's refresher says it took a renewal up once its reload command returns, which
    can be after the server has begun to serve the new certificate (it may reload on its own)."""
    wait_for("the image's refresher to report the renewal",
             lambda: "renewed certificate from /etc/casque-tls taken up" in log.read_text(errors="replace"),
             timeout=120)


def served_certificate(address: str, port: int, pem: Path) -> bytes:
    """The certificate (DER) a TLS server there presents, checked against the Secret's CA."""
    context = ssl.create_default_context(cafile=str(pem / "ca.crt"))
    context.check_hostname = False
    with socket.create_connection((address, port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=address) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_three_zookeeper_containers_form_an_ensemble_from_zoo_servers(backend_containers: Containers,
                                                                     tmp_path: Path) -> None:
    """As the chart runs three members with backends.tls: the same ZOO_SERVERS for each, each
    its own myid in /data (the chart's init container writes it; here the test, into a volume
    of its own), clients on the TLS port and the members' own traffic (quorum and election)
    over TLS, each member presenting the Secret's certificate to the others. Before, the
    quorum spoke plain text, and anyone on the pod network could read or inject it."""
    from kazoo.client import KazooClient

    pem = tls_secret(tmp_path, ["casque-zookeeper.test"])
    ports = [(reserved_port(), reserved_port(), reserved_port(), reserved_port()) for _ in range(3)]
    servers = " ".join(f"server.{n}=127.0.0.1:{quorum}:{election};{client}"
                       for n, (client, quorum, election, _) in enumerate(ports, start=1))
    members = []
    for n, (client_port, _, _, secure_port) in enumerate(ports, start=1):
        data = tmp_path / f"data-{n}"
        data.mkdir()
        (data / "myid").write_text(f"{n}\n")
        os.chown(data, IMAGE_USER, IMAGE_USER)
        members.append(backend_containers.start(
            backend_containers.images.zookeeper,  # type: ignore[union-attr]
            options=(*env_options({"ZOO_SERVERS": servers, "ZOO_CLIENT_PORT": str(client_port), "ZOO_HEAP_MB": "128",
                                   "ZOO_TLS_DIR": "/etc/casque-tls", "ZOO_SECURE_CLIENT_PORT": str(secure_port),
                                   "ZOO_QUORUM_TLS": "true"}),
                     "--volume", f"{data}:/data", "--volume", f"{pem}:/etc/casque-tls:ro"),
        ))

    def all_serving() -> bool:
        for process, log, _ in members:
            if process.poll() is not None:
                pytest.fail(f"a ZooKeeper member exited {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        return all(podman("exec", name, "/opt/zookeeper/bin/serving", check=False).returncode == 0
                   for _, _, name in members)

    wait_for("all three members' `serving` to succeed", all_serving, timeout=180)
    modes = []
    for (_, _, name), (client_port, _, _, _) in zip(members, ports):
        answer = podman("exec", name, "bash", "-c",
                        f"exec 3<>/dev/tcp/127.0.0.1/{client_port}; printf srvr >&3; cat <&3").stdout
        modes += [line.split(":", 1)[1].strip() for line in answer.splitlines() if line.startswith("Mode:")]
    assert sorted(modes) == ["follower", "follower", "leader"]
    # Every member's election port speaks TLS, and takes only a peer with a certificate of the CA.
    for _, _, election, _ in ports:
        assert tls_handshake("127.0.0.1", election, pem, with_certificate=True), election
        assert not tls_handshake("127.0.0.1", election, pem, with_certificate=False), election
    tls = zk.tls_options(Settings(zookeeper_tls=ZooKeeperTlsSettings(enabled=True, ca_file=pem / "ca.crt",
                                                                    verify_hostname=False)))
    writer = KazooClient(hosts=f"127.0.0.1:{ports[0][3]}", timeout=10.0, **tls)
    reader = KazooClient(hosts=f"127.0.0.1:{ports[2][3]}", timeout=10.0, **tls)
    writer.start(timeout=30)
    reader.start(timeout=30)
    try:
        writer.create("/casque-image/ensemble", b"quorum", makepath=True)
        reader.sync("/casque-image/ensemble")
        assert reader.get("/casque-image/ensemble")[0] == b"quorum"
    finally:
        for client in (writer, reader):
            client.stop()
            client.close()


def tls_handshake(address: str, port: int, pem: Path, *, with_certificate: bool) -> bool:
    """Whether a TLS client trusting the Secret's CA completes a handshake there, and the
    server then takes it (a server that requires a peer's certificate ends a connection without
    one at once; TLS 1.3 tells the client only when it next reads)."""
    context = ssl.create_default_context(cafile=str(pem / "ca.crt"))
    context.check_hostname = False
    if with_certificate:
        context.load_cert_chain(str(pem / "tls.crt"), str(pem / "tls.key"))
    try:
        with socket.create_connection((address, port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=address) as tls:
            tls.settimeout(2)
            try:
                return tls.recv(1) != b""  # a peer's protocol speaks first: still taken
            except TimeoutError:
                return True  # nothing said, nothing refused
    except (ssl.SSLError, ConnectionError, OSError):
        return False


def test_the_cassandra_container_takes_logins_only_once_secured_takes_a_table_and_stops_on_sigterm(
    backend_containers: Containers,
) -> None:
    """Secure by default: the image checks logins, and `secure_cassandra` (the chart's operator
    init container) replaces its default superuser by the installation's login, once."""
    from cassandra.auth import PlainTextAuthProvider
    from cassandra.cluster import Cluster, NoHostAvailable

    # An address of its own on the loopback range, so that its ports (9042, 7000) meet no other
    # server on the host's network; JMX listens on 127.0.0.1, so it gets a free port.
    address = f"127.{random.randint(64, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    started = time.monotonic()
    process, log, name = backend_containers.start(
        backend_containers.images.cassandra,  # type: ignore[union-attr]
        options=(*env_options({"CASSANDRA_LISTEN_ADDRESS": address, "CASSANDRA_CLUSTER_NAME": "casque-image-test",
                               "CASSANDRA_JMX_PORT": str(reserved_port())}), "--memory", "2g"),
    )

    def cql_session() -> object | None:
        if process.poll() is not None:
            pytest.fail(f"the Cassandra container exited {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        if "Starting listening for CQL clients" not in log.read_text(errors="replace"):
            return None
        cluster = Cluster([address], connect_timeout=5, auth_provider=PlainTextAuthProvider(*DEFAULT_LOGIN))
        try:
            return cluster, cluster.connect()
        except Exception:
            cluster.shutdown()
            return None

    # The default superuser logs in before anything is secured: that is what the set-up uses.
    default_cluster, _ = wait_for("Cassandra to answer CQL", cql_session, timeout=300)  # type: ignore[misc]
    default_cluster.shutdown()
    print(f"Cassandra answered CQL {time.monotonic() - started:.1f}s after `podman run`")
    # Without a login, nothing.
    anonymous = Cluster([address], connect_timeout=5)
    with pytest.raises(NoHostAvailable, match="AuthenticationFailed|requires authentication"):
        anonymous.connect()
    anonymous.shutdown()

    settings = installation_settings(address, secrets.token_urlsafe(32))
    first = secure_cassandra(settings)
    assert (first.role_created, first.default_disabled, first.replication_changed) == (True, True, True)
    # Every operator start runs it again: nothing left to change.
    assert secure_cassandra(settings) == Secured(role_created=False, default_disabled=False, replication_changed=False)

    def default_refused() -> bool:
        # Logins are cached by the node for a moment (credentials_validity, 2 s).
        refused = Cluster([address], connect_timeout=5, auth_provider=PlainTextAuthProvider(*DEFAULT_LOGIN))
        try:
            refused.connect()
            return False
        except NoHostAvailable as error:
            return "AuthenticationFailed" in str(error)
        finally:
            refused.shutdown()

    wait_for("the default superuser refused", default_refused, timeout=60)
    # A Secret made anew after the set-up: neither login works, and the error says what to do.
    with pytest.raises(AccessDenied, match="exists with another password than CASQUE_CASSANDRA_PASSWORD"):
        secure_cassandra(installation_settings(address, secrets.token_urlsafe(32)))

    cluster, session = connect(settings)
    try:
        assert session.execute("SELECT replication FROM system_schema.keyspaces "
                               "WHERE keyspace_name = 'system_auth'").one().replication == {
            "class": "org.apache.cassandra.locator.NetworkTopologyStrategy", "dc1": "1"}
        session.execute("CREATE KEYSPACE image_test WITH replication = "
                        "{'class': 'NetworkTopologyStrategy', 'dc1': 1}")
        session.execute("CREATE TABLE image_test.t (k text PRIMARY KEY, v int)")
        session.execute("INSERT INTO image_test.t (k, v) VALUES ('a', 1)")
        assert [tuple(row) for row in session.execute("SELECT k, v FROM image_test.t")] == [("a", 1)]
        local = session.execute("SELECT cluster_name, data_center, rack FROM system.local").one()
        assert tuple(local) == ("casque-image-test", "dc1", "rack1")
    finally:
        cluster.shutdown()
    text = log.read_text(errors="replace")
    # Half of the 2 GiB limit.
    assert "heap 1024M" in text
    # SIGTERM, then SIGKILL after podman's default 10 s: the JVM, PID 1, drains and exits on
    # the first, with 143 (128 + SIGTERM); 137 would mean podman had to kill it.
    stop = podman("stop", name, timeout=120)
    assert stop.returncode == 0
    assert process.wait(60) == 143, log.read_text(errors="replace")[-3000:]
    assert "Cassandra shutdown complete" in log.read_text(errors="replace")


DEFAULT_LOGIN = (DEFAULT_SUPERUSER, DEFAULT_PASSWORD)


def installation_settings(address: str, password: str, ca: Path | None = None) -> Settings:
    """What the chart's operator init container runs `secure-cassandra` with, for one node
    (over TLS trusting `ca`, if given; a node's address is not a name its certificate carries)."""
    tls = CassandraTlsSettings() if ca is None else CassandraTlsSettings(enabled=True, ca_file=ca,
                                                                         verify_hostname=False)
    return Settings(cassandra_contact_points=[address], cassandra_local_dc="dc1", cassandra_username="casque",
                    cassandra_password=SecretStr(password), cassandra_tls=tls,
                    replication=ReplicationSettings(strategy="NetworkTopologyStrategy", datacenters={"dc1": 1}))


# --- a ring of casque-cassandra containers ----------------------------------------------------


RING_HEAP = "640M"
RING_MEMORY = "1536m"


class RingNode:
    """One casque-cassandra container of a ring on a podman network, and a driver session
    that talks to it alone: in a ring, what a node says is per node."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], log: Path, ca: Path | None = None) -> None:
        self.name = name
        self.process = process
        self.log = log
        self.ca = ca  # CQL over TLS, trusting this CA
        self.address = ""
        self.cluster: Any = None
        self.session: Any = None
        # Until the ring is secured, the image's default superuser.
        self.credentials = DEFAULT_LOGIN

    def log_in_as(self, credentials: tuple[str, str]) -> None:
        """A new session with other credentials (an open one stays authenticated as it was)."""
        self.close()
        self.cluster = self.session = None
        self.credentials = credentials
        assert self.connected()

    def check_running(self) -> None:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-4000:]
            pytest.fail(f"{self.name} exited {self.process.returncode}:\n{tail}")

    def connected(self) -> bool:
        """Whether the node answers CQL (it starts serving clients only once it has joined
        the ring); the session stays open for the rest of the test."""
        from cassandra.auth import PlainTextAuthProvider
        from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
        from cassandra.policies import WhiteListRoundRobinPolicy

        self.check_running()
        if self.session is not None:
            return True
        text = self.log.read_text(errors="replace")
        # bin/render-config names the address the node listens on: what its host name resolves to.
        listening = re.search(r"listening on ([0-9.]+),", text)
        if listening is None or "Starting listening for CQL clients" not in text:
            return False
        self.address = listening.group(1)
        only_this = ExecutionProfile(load_balancing_policy=WhiteListRoundRobinPolicy([self.address]))
        cluster = Cluster([self.address], connect_timeout=5, execution_profiles={EXEC_PROFILE_DEFAULT: only_this},
                          auth_provider=PlainTextAuthProvider(*self.credentials), ssl_context=self._tls())
        try:
            self.session = cluster.connect()
        except Exception:
            cluster.shutdown()
            return False
        self.cluster = cluster
        return True

    def _tls(self) -> ssl.SSLContext | None:
        if self.ca is None:
            return None
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = False
        return context

    def gossip(self) -> dict[str, str]:
        """What this node's gossip says of each node it knows, itself included: address, and
        the state it announces (NORMAL, BOOT, shutdown ...). Other nodes announce it in
        STATUS_WITH_PORT only; the old STATUS stays empty for them until they shut down."""
        rows = self.session.execute("SELECT address, status_with_port FROM system_views.gossip_info")
        return {str(row.address): (row.status_with_port or "").split(",")[0] for row in rows}

    def described_peers(self) -> set[str]:
        """The peers this node describes fully enough for a driver to use them."""
        rows = self.session.execute("SELECT host_id, data_center, rack, native_address, tokens FROM system.peers_v2")
        return {str(row.native_address) for row in rows
                if row.host_id and row.data_center and row.rack and row.native_address and row.tokens}

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()


# Three JVMs start one after the other, each joining node waits out Cassandra's ring delay (30 s).
@pytest.mark.timeout(1200)
def test_three_cassandra_containers_form_a_ring_that_reads_at_quorum_with_a_node_down(
    backend_containers: Containers, tmp_path: Path,
) -> None:
    """As the chart runs a ring with backends.tls: one CASSANDRA_SEEDS for every node (the
    first), each node's address what its name resolves to, one at a time, for Cassandra
    bootstraps one node at a time and a node joins only once the ring it joins agrees on who
    is in it; clients over TLS, and the nodes' own traffic (gossip, streaming, mutations) over
    TLS too, each node presenting the Secret's certificate to the others. Before, that traffic
    was plain text to anyone on the pod network."""
    from cassandra import ConsistencyLevel, Unavailable
    from cassandra.policies import FallthroughRetryPolicy
    from cassandra.query import SimpleStatement

    network = backend_containers.network()
    names = [backend_containers.name() for _ in range(3)]
    pem = tls_secret(tmp_path, names)
    nodes: list[RingNode] = []
    first_started = time.monotonic()
    try:
        for n, name in enumerate(names, start=1):
            started = time.monotonic()
            process, log, _ = backend_containers.start(
                backend_containers.images.cassandra,  # type: ignore[union-attr]
                name=name, network=network,
                options=(*env_options({"CASSANDRA_CLUSTER_NAME": "casque-ring-test", "CASSANDRA_SEEDS": names[0],
                                       "CASSANDRA_DC": "dc1", "CASSANDRA_RACK": f"rack{n}",
                                       "MAX_HEAP_SIZE": RING_HEAP, "CASSANDRA_TLS_DIR": "/etc/casque-tls",
                                       "CASSANDRA_INTERNODE_TLS": "true"}),
                         "--volume", f"{pem}:/etc/casque-tls:ro", "--memory", RING_MEMORY),
            )
            node = RingNode(name, process, log, ca=pem / "ca.crt")
            nodes.append(node)

            def joined() -> bool:
                # Up and Normal in every started node's view, and described to drivers by each.
                for other in nodes:
                    other.check_running()
                if not all(other.connected() for other in nodes):
                    return False
                addresses = {other.address for other in nodes}
                for other in nodes:
                    gossip = other.gossip()
                    if any(gossip.get(address) != "NORMAL" for address in addresses):
                        return False
                    if other.described_peers() != addresses - {other.address}:
                        return False
                return True

            wait_for(f"{name} to join the ring as node {n}", joined, timeout=300)
            print(f"node {n} answered CQL in the ring {time.monotonic() - started:.1f}s after `podman run`")
        print(f"the ring of 3 formed {time.monotonic() - first_started:.1f}s after the first `podman run`")

        first, second, third = nodes
        assert len({node.address for node in nodes}) == 3
        assert "internode traffic over TLS" in first.log.read_text(errors="replace")
        # The storage port speaks TLS, and takes only a peer with a certificate of the CA.
        for node in nodes:
            assert tls_handshake(node.address, 7000, pem, with_certificate=True), node.name
            assert not tls_handshake(node.address, 7000, pem, with_certificate=False), node.name
        # As the chart's operator pods do, once every node is up: system_auth gets a replica on
        # each node, so that a login survives a node's loss.
        password = secrets.token_urlsafe(32)
        settings = installation_settings(first.address, password, ca=pem / "ca.crt").model_copy(
            update={"replication": ReplicationSettings(strategy="NetworkTopologyStrategy", datacenters={"dc1": 3})})
        secured = secure_cassandra(settings)
        assert secured.role_created and secured.default_disabled and secured.replication_changed
        for node in nodes:
            node.log_in_as(("casque", password))
        assert first.session.execute("SELECT cluster_name FROM system.local").one().cluster_name == "casque-ring-test"
        racks = {str(row.peer): row.rack for row in first.session.execute("SELECT peer, rack FROM system.peers")}
        assert racks == {second.address: "rack2", third.address: "rack3"}
        first.session.execute("CREATE KEYSPACE ring_test WITH replication = "
                              "{'class': 'NetworkTopologyStrategy', 'dc1': 3}")
        first.session.execute("CREATE TABLE ring_test.t (k text PRIMARY KEY, v int)")

        def has_table(node: RingNode) -> bool:
            rows = node.session.execute("SELECT table_name FROM system_schema.tables WHERE keyspace_name = 'ring_test'")
            return [row.table_name for row in rows] == ["t"]

        wait_for("every node to have the table", lambda: all(has_table(node) for node in nodes), timeout=120)
        first.session.execute(SimpleStatement("INSERT INTO ring_test.t (k, v) VALUES ('a', 1)",
                                              consistency_level=ConsistencyLevel.QUORUM))
        select = SimpleStatement("SELECT k, v FROM ring_test.t WHERE k = 'a'",
                                 consistency_level=ConsistencyLevel.QUORUM)
        assert [tuple(row) for row in second.session.execute(select)] == [("a", 1)]

        # A node stops as a pod does: SIGTERM, on which it drains and tells the ring it is
        # shutting down; the others then count it out at once.
        assert podman("stop", third.name, timeout=120).returncode == 0
        assert third.process.wait(60) == 143
        wait_for(f"{second.name} to see {third.name} shut down",
                 lambda: second.gossip().get(third.address) == "shutdown", timeout=60)
        assert [tuple(row) for row in second.session.execute(select)] == [("a", 1)]
        # Two of three replicas answer a QUORUM, not ALL: the read above did without the third.
        # (Without a retry policy of its own the driver would retry on another host first.)
        everyone = SimpleStatement("SELECT k, v FROM ring_test.t WHERE k = 'a'",
                                   consistency_level=ConsistencyLevel.ALL, retry_policy=FallthroughRetryPolicy())
        with pytest.raises(Unavailable) as refused:
            second.session.execute(everyone)
        assert (refused.value.alive_replicas, refused.value.required_replicas) == (2, 3)
        # Logins are read at a quorum of system_auth's replicas, one on each node: two still
        # answer, so the installation still logs in (a node may also answer from its cache).
        second.log_in_as(("casque", password))
        assert [tuple(row) for row in second.session.execute(select)] == [("a", 1)]
        auth = second.session.execute("SELECT replication FROM system_schema.keyspaces "
                                      "WHERE keyspace_name = 'system_auth'").one().replication
        assert auth == {"class": "org.apache.cassandra.locator.NetworkTopologyStrategy", "dc1": "3"}
    finally:
        for node in nodes:
            node.close()
