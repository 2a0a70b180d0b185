"""The local stack: a ZooKeeper (one server or an ensemble) and a Cassandra node or ring,
owned by one state directory.

`up` is idempotent: it starts only what is not already running from the same directory,
and `down` stops exactly the processes whose pid files and owner markers say are ours.
The layout (node counts, ports) is saved in `stack.json` so that `status`, `logs` and
`down` act on what `up` really started.

A stack of two datacenters splits its nodes into dc1 (the first half, rounded up) and dc2,
each node telling the others its datacenter through GossipingPropertyFileSnitch; a stack of
one keeps SimpleSnitch (and the single datacenter `datacenter1` that it names).

A stack with `tls` makes a CA and certificates in `root/tls` (casque.devstack.pki) and
serves CQL over TLS only, and ZooKeeper on a TLS port next to its plaintext one; with
`client_auth` both require a client certificate of that CA. With `password_auth` Cassandra
runs PasswordAuthenticator, and clients log in as a superuser role `casque` whose random
password is made in `root` on first use (the default superuser's is too short for casque).
With `zookeeper_sasl` ZooKeeper also takes SASL DIGEST-MD5 logins of the installation user,
whose password is made in `root` on first use (casque.devstack.zookeeper). With `isolation`
(which needs both) the clients' settings give each namespace a keyspace and a role of its
own and a ZooKeeper identity, derived from a key made in `root`: what a default install of
the chart does. `client_env` gives the CASQUE_* settings that reach the stack.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from casque.devstack import artifacts
from casque.devstack.cassandra import CassandraLogin, CassandraNode
from casque.devstack.pki import LocalPki
from casque.devstack.zookeeper import SaslLogin, ZooKeeperEnsemble, write_private
from casque.errors import CasqueError, StackError

if TYPE_CHECKING:
    from casque.config import Settings

Report = Callable[[str], None]


@dataclass(frozen=True)
class StackPorts:
    native: int = 9042
    storage: int = 7000
    jmx: int = 7199
    zookeeper: int = 2181
    # An ensemble's member N uses each of the three ZooKeeper ports + N - 1.
    zookeeper_quorum: int = 2888
    zookeeper_election: int = 3888


# Nodes live on 127.0.0.1..MAX_NODES; node N's JMX port is the stack's + 100 * (N - 1).
MAX_NODES = 4
MAX_DATACENTERS = 2


def datacenter_names(nodes: int, datacenters: int) -> list[str | None]:
    """The datacenter of each of `nodes` nodes (None: one datacenter, SimpleSnitch).

    Contiguous halves, the first one the larger, so node 1 (the seed) is in dc1 and each
    datacenter has at least one node."""
    if not 1 <= datacenters <= MAX_DATACENTERS:
        raise StackError(f"{datacenters} datacenters: the local stack runs 1 or {MAX_DATACENTERS}")
    if not 1 <= nodes <= MAX_NODES:
        raise StackError(f"{nodes} Cassandra nodes: the local stack runs 1 to {MAX_NODES}")
    if datacenters == 1:
        return [None] * nodes
    if nodes < datacenters:
        raise StackError(f"{nodes} Cassandra nodes cannot fill {datacenters} datacenters")
    first = (nodes + datacenters - 1) // datacenters
    return [f"dc{1 if i < first else 2}" for i in range(nodes)]


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    address: str
    pid: int | None
    log: Path
    datacenter: str | None = None

    @property
    def running(self) -> bool:
        return self.pid is not None


@dataclass(frozen=True)
class Stack:
    root: Path
    nodes: int = 1
    ports: StackPorts = field(default_factory=StackPorts)
    heap_mb: int = 1536
    cluster_name: str = "casque-dev"
    zookeeper_nodes: int = 1
    datacenters: int = 1
    tls: bool = False
    client_auth: bool = False
    password_auth: bool = False
    # A one-node stack on another address than the loopback's, e.g. the host's own, where
    # pods on a node of this machine reach it (127.0.0.1 in a pod is the pod's loopback).
    address: str | None = None
    zookeeper_sasl: bool = False
    isolation: bool = False
    # Servers that live for minutes (the test suite's): their JVMs compile with C1 only
    # (casque.devstack.jvm), and Cassandra does not flush its schema at each change.
    short_lived: bool = False

    @property
    def state_file(self) -> Path:
        return self.root / "stack.json"

    @property
    def pki(self) -> LocalPki | None:
        return LocalPki(self.root / "tls") if self.tls else None

    @property
    def zookeeper_sasl_login(self) -> SaslLogin | None:
        """The installation user that ZooKeeper logs in over SASL (None without SASL)."""
        return SaslLogin(self.root / "zookeeper-sasl.password") if self.zookeeper_sasl else None

    @property
    def cassandra_login(self) -> CassandraLogin | None:
        """The installation's Cassandra login (None without `password_auth`)."""
        return CassandraLogin(self.root / "cassandra-installation.password") if self.password_auth else None

    @property
    def zookeeper_tls_hosts(self) -> str | None:
        """The connect string of ZooKeeper's TLS port (None without TLS)."""
        return self.zookeeper().members()[0].secure_connect_string

    def client_env(self) -> dict[str, str]:
        """The CASQUE_* settings of a client of this stack: TLS with the stack's CA (and
        client certificate), the installation's Cassandra login."""
        env = {
            "CASQUE_CASSANDRA_CONTACT_POINTS": ",".join(self.contact_points),
            "CASQUE_CASSANDRA_PORT": str(self.ports.native),
            "CASQUE_ZOOKEEPER_HOSTS": self.zookeeper_tls_hosts or self.zookeeper_hosts,
        }
        pki = self.pki
        if pki is not None:
            for backend in ("CASSANDRA", "ZOOKEEPER"):
                env[f"CASQUE_{backend}_TLS_ENABLED"] = "true"
                env[f"CASQUE_{backend}_TLS_CA_FILE"] = str(pki.ca_crt)
                if self.client_auth:
                    env[f"CASQUE_{backend}_TLS_CERT_FILE"] = str(pki.client_crt)
                    env[f"CASQUE_{backend}_TLS_KEY_FILE"] = str(pki.client_key)
        login = self.cassandra_login
        if login is not None:
            login.ensure()  # the password `up` gives the role, if `up` has not run yet
            env["CASQUE_CASSANDRA_USERNAME"], env["CASQUE_CASSANDRA_PASSWORD"] = login.username, login.password()
        sasl = self.zookeeper_sasl_login
        if sasl is not None:
            # The login is the ensemble's superuser: an operator closes `/` and `/zookeeper`.
            env["CASQUE_ZOOKEEPER_OWNED_ENSEMBLE"] = "true"
            env["CASQUE_ZOOKEEPER_SASL"] = "true"
            env["CASQUE_ZOOKEEPER_USERNAME"] = sasl.username
            env["CASQUE_ZOOKEEPER_PASSWORD"] = sasl.password()
        if self.isolation:
            env["CASQUE_CASSANDRA_ISOLATION"] = "keyspace"
        if sasl is not None or self.isolation:
            # The namespaces' ZooKeeper identities and Cassandra roles derive from it.
            env["CASQUE_DERIVATION_KEY"] = self.derivation_key()
        return env

    def derivation_key(self) -> str:
        """The installation's derivation key (casque.derivation): made on first use and kept
        in `<root>/derivation.key` (mode 0600), so a restarted stack's namespaces keep their
        identities."""
        path = self.root / "derivation.key"
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32) + "\n")
        return path.read_text().strip()

    @property
    def contact_points(self) -> list[str]:
        return [node.address for node in self.cassandra_nodes()]

    @property
    def zookeeper_hosts(self) -> str:
        return self.zookeeper().connect_string

    def cassandra_nodes(self) -> list[CassandraNode]:
        if self.address is not None and self.nodes != 1:
            raise StackError(f"a stack on {self.address} runs one Cassandra node, not {self.nodes}")
        return [
            CassandraNode(
                directory=self.root / f"cassandra-{i}",
                address=self.address or f"127.0.0.{i}",
                native_port=self.ports.native,
                storage_port=self.ports.storage,
                jmx_port=self.ports.jmx + 100 * (i - 1),
                seeds=self.address or "127.0.0.1",
                cluster_name=self.cluster_name,
                heap_mb=self.heap_mb,
                datacenter=datacenter,
                pki=self.pki,
                require_client_auth=self.client_auth,
                password_auth=self.password_auth,
                login=self.cassandra_login,
                short_lived=self.short_lived,
            )
            for i, datacenter in enumerate(datacenter_names(self.nodes, self.datacenters), start=1)
        ]

    def zookeeper(self) -> ZooKeeperEnsemble:
        return ZooKeeperEnsemble(root=self.root, size=self.zookeeper_nodes, address=self.address or "127.0.0.1",
                                 client_port=self.ports.zookeeper,
                                 quorum_port=self.ports.zookeeper_quorum,
                                 election_port=self.ports.zookeeper_election,
                                 pki=self.pki, require_client_auth=self.client_auth,
                                 sasl=self.zookeeper_sasl_login, short_lived=self.short_lived)

    @classmethod
    def load(cls, root: Path) -> Stack | None:
        """The stack that an earlier `up` recorded in `root`, if any."""
        try:
            saved = json.loads((root / "stack.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(
            root=root,
            nodes=int(saved["nodes"]),
            ports=StackPorts(**saved["ports"]),
            heap_mb=int(saved["heap_mb"]),
            cluster_name=str(saved["cluster_name"]),
            zookeeper_nodes=int(saved.get("zookeeper_nodes", 1)),
            # Stacks recorded before datacenters existed ran one.
            datacenters=int(saved.get("datacenters", 1)),
            tls=bool(saved.get("tls", False)),
            client_auth=bool(saved.get("client_auth", False)),
            password_auth=bool(saved.get("password_auth", False)),
            address=saved.get("address"),
            zookeeper_sasl=bool(saved.get("zookeeper_sasl", False)),
            isolation=bool(saved.get("isolation", False)),
            short_lived=bool(saved.get("short_lived", False)),
        )

    def _save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        saved: dict[str, object] = {
            "nodes": self.nodes, "ports": asdict(self.ports), "heap_mb": self.heap_mb,
            "cluster_name": self.cluster_name, "zookeeper_nodes": self.zookeeper_nodes,
            "tls": self.tls, "client_auth": self.client_auth, "password_auth": self.password_auth,
            "zookeeper_sasl": self.zookeeper_sasl, "isolation": self.isolation,
        }
        if self.short_lived:
            saved["short_lived"] = True
        if self.datacenters != 1:
            saved["datacenters"] = self.datacenters
        if self.address is not None:
            saved["address"] = self.address
        self.state_file.write_text(json.dumps(saved, indent=2))

    def status(self) -> list[ServiceStatus]:
        services = [ServiceStatus(zk.name, zk.connect_string, zk.pid(), zk.log_path)
                    for zk in self.zookeeper().members()]
        for i, node in enumerate(self.cassandra_nodes(), start=1):
            services.append(
                ServiceStatus(f"cassandra-{i}", f"{node.address}:{node.native_port}", node.pid(), node.log_path,
                              node.datacenter or "datacenter1")
            )
        return services

    def up(self, report: Report = lambda _: None) -> None:
        """Start whatever is not running and wait until CQL and ZooKeeper answer."""
        recorded = Stack.load(self.root)
        if recorded is not None and recorded != self and any(s.running for s in recorded.status()):
            raise StackError(
                f"a {recorded.nodes}-node stack with other settings runs from {self.root}; "
                "run `casque dev down` first"
            )
        report("resolving Cassandra and ZooKeeper from Maven Central (cached after the first run)")
        artifacts.ensure_all()
        self._save()
        pki = self.pki
        if pki is not None:
            report(f"TLS certificates in {pki.directory}")
            pki.ensure(self.contact_points)
        sasl = self.zookeeper_sasl_login
        if sasl is not None:
            report(f"ZooKeeper SASL user {sasl.username!r}, its password in {sasl.password_file}")
            sasl.ensure()
        login = self.cassandra_login
        if login is not None:
            login.ensure()
        try:
            self._start_all(report)
        except BaseException:
            # Leave nothing half-started behind: the next `up` starts from a clean slate.
            self.down()
            raise

    def _start_all(self, report: Report) -> None:
        ensemble = self.zookeeper()
        for zk in ensemble.members():
            if zk.pid() is None:
                for port, what in zk.ports():
                    _require_free(zk.address, port, what)
                report(f"starting ZooKeeper on {zk.connect_string}")
                zk.start()
        ensemble.wait_ready()
        if self.zookeeper_sasl:
            self._close_zookeeper(report)

        nodes = self.cassandra_nodes()
        seed, others = nodes[0], nodes[1:]
        # The seed first: the others join the ring through it.
        self._start_node(seed, report)
        seed.wait_ready()
        for node in others:
            self._start_node(node, report)
        for node in others:
            node.wait_ready()
        if others:
            self._wait_ring_normal(seed)
        login = self.cassandra_login
        if login is not None:
            report(f"Cassandra superuser {login.username!r}, its password in {login.password_file}; "
                   "the default superuser disabled")
            self._secure_cassandra(login)

    def zookeeper_client_options(self) -> dict[str, object]:
        """KazooClient's arguments of the installation on the TLS port (or the plain one): the
        stack's certificates and, with SASL, its login, which may create at the root."""
        options: dict[str, object] = dict(self.zookeeper().client_options())
        sasl = self.zookeeper_sasl_login
        if sasl is not None:
            options["sasl_options"] = {"mechanism": "DIGEST-MD5", "username": sasl.username,
                                       "password": sasl.password()}
        return options

    def zookeeper_settings(self) -> Settings:
        """The installation's ZooKeeper settings: the TLS port if any, the SASL login (the
        servers' superuser) if any, and the derivation key the login's ACLs need."""
        from pydantic import SecretStr

        from casque.config import Settings, ZooKeeperTlsSettings  # noqa: F811  # at run time too

        pki, sasl = self.pki, self.zookeeper_sasl_login
        tls = ZooKeeperTlsSettings() if pki is None else ZooKeeperTlsSettings(
            enabled=True, ca_file=pki.ca_crt, cert_file=pki.client_crt if self.client_auth else None,
            key_file=pki.client_key if self.client_auth else None)
        login: dict[str, object] = {} if sasl is None else {
            "zookeeper_sasl": True, "zookeeper_username": sasl.username,
            "zookeeper_password": SecretStr(sasl.password()), "derivation_key": SecretStr(self.derivation_key())}
        return Settings(zookeeper_hosts=self.zookeeper_tls_hosts or self.zookeeper_hosts, zookeeper_tls=tls,
                        **login)  # type: ignore[arg-type]  # pydantic validates the mapping

    def _close_zookeeper(self, report: Report) -> None:
        """`/`, `/zookeeper` and `/zookeeper/quota` closed to every login but the
        installation's SASL user, as the chart's operator closes its embedded ensemble
        (casque.backends.ensemble_acl): the stack's ensemble is the installation's own."""
        from casque.backends import zk
        from casque.backends.ensemble_acl import close_owned_ensemble

        client = zk.connect(self.zookeeper_settings())
        try:
            closed = close_owned_ensemble(client)
        finally:
            client.stop()
            client.close()
        if closed:
            report(f"ZooKeeper's {', '.join(closed)} closed to every login but the installation's (anyone may read)")

    def _secure_cassandra(self, login: CassandraLogin) -> None:
        """The installation's login made the ring's superuser and the default one disabled,
        every node able to check both before this returns: what `casque secure-cassandra`
        does to the chart's ring (casque.backends.superuser)."""
        from casque.backends.superuser import secure_cassandra
        from pydantic import SecretStr

        from casque.config import CassandraTlsSettings, Settings

        pki = self.pki
        tls = CassandraTlsSettings() if pki is None else CassandraTlsSettings(
            enabled=True, ca_file=pki.ca_crt, cert_file=pki.client_crt if self.client_auth else None,
            key_file=pki.client_key if self.client_auth else None)
        settings = Settings(cassandra_contact_points=self.contact_points, cassandra_port=self.ports.native,
                            cassandra_username=login.username, cassandra_password=SecretStr(login.password()),
                            cassandra_tls=tls)
        try:
            secure_cassandra(settings)
        except CasqueError as error:
            raise StackError(f"Cassandra's logins could not be secured: {error}") from error

    def _wait_ring_normal(self, seed: CassandraNode, timeout: float = 180.0) -> None:
        """A node answers CQL before the others see it as Up/Normal, and before every node
        describes it fully to drivers (a driver told of it by such a node ignores it); wait
        until both hold."""
        deadline = time.monotonic() + timeout
        nodes = self.cassandra_nodes()
        while True:
            status = seed.nodetool("status")
            normal = sum(1 for line in status.splitlines() if line.startswith("UN "))
            if normal == self.nodes:
                break
            if time.monotonic() > deadline:
                raise StackError(f"only {normal} of {self.nodes} Cassandra nodes are Up/Normal after {timeout:.0f}s")
            time.sleep(1.0)
        for node in nodes:
            others = {other.address for other in nodes if other is not node}
            while (missing := others - node.driver_peers()):
                if time.monotonic() > deadline:
                    raise StackError(f"Cassandra {node.address} does not describe {sorted(missing)} to drivers "
                                     f"after {timeout:.0f}s")
                time.sleep(0.5)

    def _start_node(self, node: CassandraNode, report: Report) -> None:
        if node.pid() is not None:
            return
        _require_free(node.address, node.native_port, "Cassandra CQL")
        _require_free(node.address, node.storage_port, "Cassandra storage")
        _wait_bindable(node.address, node.storage_port, "Cassandra storage")
        _require_free("127.0.0.1", node.jmx_port, "Cassandra JMX")
        report(f"starting Cassandra on {node.address}:{node.native_port}")
        node.start()

    def down(self, report: Report = lambda _: None) -> None:
        """Stop every process this stack started: Cassandra first, ZooKeeper last."""
        for node in reversed(self.cassandra_nodes()):
            if node.stop():
                report(f"stopped Cassandra {node.address}")
        for zk in self.zookeeper().stop():
            report(f"stopped ZooKeeper {zk.connect_string}")


def _require_free(address: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        if probe.connect_ex((address, port)) == 0:
            raise StackError(
                f"{what} port {address}:{port} is already in use by a process this stack did not start"
            )


def _wait_bindable(address: str, port: int, what: str, timeout: float = 90.0) -> None:
    """Wait until a listening socket can bind `address:port`.

    Cassandra binds its storage port without SO_REUSEADDR, so a connection of a node
    stopped moments ago, left in TIME_WAIT on that port (for up to a minute), makes the
    next start fail with "in use by another process" although nothing listens there.
    """
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
                return
            except OSError as error:
                if time.monotonic() > deadline:
                    raise StackError(f"{what} port {address}:{port} cannot be bound after {timeout:.0f}s: {error}") from error
        time.sleep(1.0)
