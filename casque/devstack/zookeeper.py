"""The ZooKeeper 3.9 of the local stack: one standalone server, or an ensemble on 127.0.0.1.

The tick is 500 ms so that the smallest session timeout is 1 s: fault tests expire
sessions on purpose and should not wait long for it. Clients still ask for their own
timeout (kazoo's default is 10 s).

An ensemble's members share the address and differ by ports: member N listens for clients
on `client_port + N - 1`, for its followers (when it leads) on `quorum_port + N - 1` and for
leader election on `election_port + N - 1`. Each has a data directory of its own with its
`myid`. The four-letter words `srvr` and `mntr` are enabled so that anyone (the fault tests
first) can ask a member whether it leads, follows, or serves nothing (no quorum).

A standalone server with `pki` also listens for TLS clients on `client_port +
SECURE_PORT_OFFSET` (ZooKeeper's secure client port needs its Netty connection factory),
refusing clients without a certificate of the stack's CA when `require_client_auth`. The
plaintext port stays open on the loopback address for the stack's own checks.

With `sasl` every server also takes SASL DIGEST-MD5 logins of one user, the installation's:
a JAAS file (`jaas.conf`, mode 0600, for it holds the password) whose `Server` section lists
the user for ZooKeeper's DigestLoginModule, given to the JVM with
`-Djava.security.auth.login.config`, and `authProvider.sasl` in zoo.cfg, without which the
server would log the user in but refuse every `sasl:` ACL entry. Digest logins keep working
next to it (the namespaces' identities are digest).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from casque.devstack import processes
from casque.devstack.artifacts import ZOOKEEPER
from casque.devstack.jvm import compiler_flags
from casque.devstack.pki import LocalPki
from casque.errors import StackError

# What a member answers to `srvr` while it serves: its role in the ensemble.
SERVING_MODES = frozenset({"leader", "follower", "standalone"})
# The TLS client port is this far above the plaintext one: 2281 next to 2181.
SECURE_PORT_OFFSET = 100
# The installation's user in the servers' JAAS file (CASQUE_ZOOKEEPER_USERNAME with SASL).
SASL_USER = "casque"
SASL_PROVIDER = "org.apache.zookeeper.server.auth.SASLAuthenticationProvider"
DIGEST_LOGIN_MODULE = "org.apache.zookeeper.server.auth.DigestLoginModule"
# The session timeouts a server grants: from 2 ticks, up to a minute. A client asking for
# more gets the minute (casque's clients warn, and trust their sessions for what was granted).
MIN_SESSION_TIMEOUT_MS = 1000
MAX_SESSION_TIMEOUT_MS = 60000


def write_private(path: Path, text: str) -> None:
    """Write a file that holds a secret, readable by its owner only from its first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    path.chmod(0o600)  # an existing file keeps its mode through O_CREAT


@dataclass(frozen=True)
class SaslLogin:
    """The SASL user that the stack's ZooKeeper servers know: its password is made on first
    use and kept in `password_file` (mode 0600), so a restarted stack keeps it."""

    password_file: Path
    username: str = SASL_USER

    def ensure(self) -> None:
        if not self.password_file.exists():
            write_private(self.password_file, secrets.token_urlsafe(32) + "\n")

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def jaas_config(self) -> str:
        """The JAAS file of a server: the `Server` section ZooKeeper reads SASL users from."""
        # Passwords from token_urlsafe need no escaping inside the quotes.
        return (f"Server {{\n  {DIGEST_LOGIN_MODULE} required\n"
                f'  user_{self.username}="{self.password()}";\n}};\n')


@dataclass(frozen=True)
class ZooKeeperServer:
    directory: Path
    address: str = "127.0.0.1"
    client_port: int = 2181
    heap_mb: int = 256
    # An ensemble member's id and the `server.N=...` lines of the whole ensemble (this member
    # included); None and () for a standalone server.
    myid: int | None = None
    peers: tuple[str, ...] = ()
    name: str = "zookeeper"
    pki: LocalPki | None = None
    require_client_auth: bool = False
    sasl: SaslLogin | None = None
    # Connections ZooKeeper takes from one client address (maxClientCnxns): a bound on what one
    # pod can hold open. The local stack's clients, the test suite's included, all come from
    # its own host's addresses, hence its larger default; the image's is ZooKeeper's own 60.
    max_client_connections: int = 500
    # A server that lives for minutes (casque.devstack.jvm): its JVM compiles with C1 only.
    short_lived: bool = False

    @property
    def connect_string(self) -> str:
        return f"{self.address}:{self.client_port}"

    @property
    def jaas_path(self) -> Path:
        return self.directory / "jaas.conf"

    @property
    def secure_port(self) -> int | None:
        return None if self.pki is None else self.client_port + SECURE_PORT_OFFSET

    @property
    def secure_connect_string(self) -> str | None:
        return None if self.secure_port is None else f"{self.address}:{self.secure_port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "zookeeper.log"

    def ports(self) -> list[tuple[int, str]]:
        """The ports this server listens on, with what each is for."""
        own = [(self.client_port, "ZooKeeper client")]
        if self.secure_port is not None:
            own.append((self.secure_port, "ZooKeeper TLS client"))
        if self.myid is not None:
            # server.N=address:quorum:election
            _, _, spec = self.peers[self.myid - 1].partition("=")
            _, quorum, election = spec.split(":")
            own += [(int(quorum), "ZooKeeper quorum"), (int(election), "ZooKeeper election")]
        return own

    def render_zoo_cfg(self, data_dir: Path | None = None) -> str:
        """zoo.cfg: the data in `data_dir` (default: `data` under the server's directory), the
        ensemble's `server.N` lines when this is a member. The backends' image renders its
        own from this one, with the members it is given (casque/devstack/backend_images.py)."""
        data = data_dir if data_dir is not None else self.directory.resolve() / "data"
        ensemble = "".join(f"{line}\n" for line in self.peers) if self.myid is not None else ""
        return (
            f"tickTime=500\ninitLimit=10\nsyncLimit=5\n"
            f"dataDir={data}\nclientPort={self.client_port}\n"
            f"clientPortAddress={self.address}\n"
            f"minSessionTimeout={MIN_SESSION_TIMEOUT_MS}\nmaxSessionTimeout={MAX_SESSION_TIMEOUT_MS}\n"
            f"maxClientCnxns={self.max_client_connections}\nadmin.enableServer=false\n"
            # `srvr` alone: the readiness probe's and devstack's. `stat` and `cons` list every
            # connected client's address, to anyone who reaches the port.
            "4lw.commands.whitelist=srvr\n"
            "autopurge.snapRetainCount=3\nautopurge.purgeInterval=1\n"
            f"{ensemble}"
            f"{self._render_tls()}"
            + (f"authProvider.sasl={SASL_PROVIDER}\n" if self.sasl is not None else "")
        )

    def render_logback(self, log_path: Path | None = None) -> str:
        return f"""<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>{log_path or self.log_path.resolve()}</file>
    <encoder><pattern>%date{{ISO8601}} %-5level [%thread] %logger{{20}} - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
"""

    def write_config(self) -> None:
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        if self.myid is not None:
            (self.directory / "data" / "myid").write_text(f"{self.myid}\n")
        (self.directory / "zoo.cfg").write_text(self.render_zoo_cfg())
        if self.sasl is not None:
            write_private(self.jaas_path, self.sasl.jaas_config())
        (self.directory / "logback.xml").write_text(self.render_logback())

    def _render_tls(self) -> str:
        if self.pki is None:
            return ""
        stores = self.pki.stores
        password = self.pki.password_file.resolve()
        # zoo.cfg keys that ZooKeeper does not know itself become `zookeeper.`-prefixed
        # system properties, which is where its X509 code reads the ssl.* settings.
        return (
            f"secureClientPort={self.secure_port}\nsecureClientPortAddress={self.address}\n"
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n"
            f"ssl.keyStore.location={stores.keystore.resolve()}\nssl.keyStore.type=PKCS12\n"
            f"ssl.keyStore.passwordPath={password}\n"
            f"ssl.trustStore.location={stores.truststore.resolve()}\nssl.trustStore.type=PKCS12\n"
            f"ssl.trustStore.passwordPath={password}\n"
            f"ssl.clientAuth={'need' if self.require_client_auth else 'none'}\n"
        )

    def java_command(self) -> list[str]:
        """The server's JVM argv. The backends' image starts ZooKeeper with this one too, its
        paths swapped for the image's (casque/devstack/backend_images.py)."""
        d = self.directory.resolve()
        # ZooKeeperServerMain cannot join an ensemble; QuorumPeerMain reads the server.N lines.
        main = ("org.apache.zookeeper.server.ZooKeeperServerMain" if self.myid is None
                else "org.apache.zookeeper.server.quorum.QuorumPeerMain")
        return [
            "java",
            processes.owner_marker(self.directory),
            f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m",
            *compiler_flags(self.short_lived),
            f"-Dlogback.configurationFile={d}/logback.xml",
            "-Dzookeeper.admin.enableServer=false",
            # A namespace's quota on znodes (casque.engine.znode_quotas) refuses creates past
            # it only with this; without, ZooKeeper merely logs them.
            "-Dzookeeper.enforceQuota=true",
            *([f"-Djava.security.auth.login.config={self.jaas_path.resolve()}",
               # The installation's login acts on every znode whatever ACL a client gave it:
               # a namespace may create znodes in its containers, and ZooKeeper lets a creator
               # name only itself in their ACL (and take ADMIN), locking the operator out.
               f"-Dzookeeper.superUser={self.sasl.username}"] if self.sasl else []),
            "-cp", ZOOKEEPER.classpath(),
            main,
            f"{d}/zoo.cfg",
        ]

    def start(self) -> int:
        self.write_config()
        processes.rotate(self.log_path)
        return processes.spawn(self.directory, self.java_command(), "stdout.log")

    def pid(self) -> int | None:
        return processes.running_pid(self.directory)

    def four_letter_word(self, word: str, timeout: float = 2.0) -> str | None:
        """The server's answer to a four-letter word (`srvr`, `mntr`, ...); None if it does not answer."""
        try:
            with socket.create_connection((self.address, self.client_port), timeout=timeout) as sock:
                sock.sendall(word.encode())
                chunks = []
                while chunk := sock.recv(4096):
                    chunks.append(chunk)
        except OSError:
            return None
        return b"".join(chunks).decode(errors="replace")

    def mode(self) -> str | None:
        """`leader`, `follower` or `standalone` while the server serves clients, else None
        (not running, or an ensemble member without a quorum, which answers no requests)."""
        answer = self.four_letter_word("srvr") or ""
        for line in answer.splitlines():
            if line.startswith("Mode:"):
                return line.partition(":")[2].strip()
        return None

    def connections(self) -> int:
        """Client connections the server holds now (0 when it does not answer)."""
        for line in (self.four_letter_word("srvr") or "").splitlines():
            if line.startswith("Connections:"):
                return int(line.partition(":")[2])
        return 0

    def failure(self, what: str) -> str:
        tail = processes.log_tail(self.log_path, 200) + processes.log_tail(self.directory / "stdout.log", 50)
        errors = [line for line in tail if "ERROR" in line or "Exception" in line]
        reason = errors[-1].strip() if errors else "no error line in the log"
        return f"ZooKeeper {self.connect_string} {what}: {reason} (log: {self.log_path})"

    def stop(self) -> bool:
        return processes.terminate(self.directory, grace_seconds=15.0)


@dataclass(frozen=True)
class ZooKeeperEnsemble:
    """One standalone server (`size` 1, in `root/zookeeper`) or `size` members (in
    `root/zookeeper-N`), started, awaited and stopped together."""

    root: Path
    size: int = 1
    address: str = "127.0.0.1"
    client_port: int = 2181
    quorum_port: int = 2888
    election_port: int = 3888
    heap_mb: int = 256
    # TLS (a secure client port) on a standalone server only.
    pki: LocalPki | None = None
    require_client_auth: bool = False
    # SASL logins on every member.
    sasl: SaslLogin | None = None
    short_lived: bool = False

    def members(self) -> list[ZooKeeperServer]:
        if self.size == 1:
            return [ZooKeeperServer(self.root / "zookeeper", self.address, self.client_port, self.heap_mb,
                                    pki=self.pki, require_client_auth=self.require_client_auth, sasl=self.sasl,
                                    short_lived=self.short_lived)]
        if self.pki is not None:
            raise StackError("the local stack runs TLS on a standalone ZooKeeper only")
        peers = tuple(
            f"server.{n}={self.address}:{self.quorum_port + n - 1}:{self.election_port + n - 1}"
            for n in range(1, self.size + 1)
        )
        return [
            ZooKeeperServer(self.root / f"zookeeper-{n}", self.address, self.client_port + n - 1, self.heap_mb,
                            myid=n, peers=peers, name=f"zookeeper-{n}", sasl=self.sasl, short_lived=self.short_lived)
            for n in range(1, self.size + 1)
        ]

    @property
    def connect_string(self) -> str:
        return ",".join(member.connect_string for member in self.members())

    def start(self) -> None:
        """Start the members that are not running (a restarted member rejoins the ensemble)."""
        for member in self.members():
            if member.pid() is None:
                member.start()

    def modes(self) -> dict[str, str | None]:
        return {member.name: member.mode() for member in self.members()}

    def leader(self) -> ZooKeeperServer | None:
        """The member that leads now (a standalone server leads itself); None during an election."""
        for member in self.members():
            if member.mode() in ("leader", "standalone"):
                return member
        return None

    def followers(self) -> list[ZooKeeperServer]:
        return [member for member in self.members() if member.mode() == "follower"]

    def serving(self, members: int | None = None) -> bool:
        """Whether there is a leader and `members` (default: all) serve clients."""
        modes = list(self.modes().values())
        wanted = self.size if members is None else members
        return (sum(1 for mode in modes if mode in SERVING_MODES) >= wanted
                and any(mode in ("leader", "standalone") for mode in modes))

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Wait until every member serves (an ensemble has elected a leader) and a client
        session on the whole connect string (and on the TLS port, if any) can read."""
        # kazoo logs every refused connection; while waiting for startup those are expected.
        logging.getLogger("kazoo.client").setLevel(logging.CRITICAL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for member in self.members():
                if member.pid() is None:
                    raise StackError(member.failure("exited during startup"))
            if not self.serving():
                time.sleep(0.2)
                continue
            if all(self._client_reads(hosts, tls) for hosts, tls in self._client_ports()):
                return
            time.sleep(0.3)
        waiting = [m for m in self.members() if m.mode() not in SERVING_MODES]
        raise StackError((waiting or self.members())[0].failure(
            f"did not serve within {timeout:.0f}s (modes {self.modes()})"))

    def _client_ports(self) -> list[tuple[str, bool]]:
        ports = [(self.connect_string, False)]
        secure = self.members()[0].secure_connect_string
        if secure is not None:
            ports.append((secure, True))
        return ports

    def client_options(self) -> dict[str, Any]:
        """KazooClient's arguments for the secure port: the stack's CA and client certificate."""
        if self.pki is None:
            return {}
        return {"use_ssl": True, "ca": str(self.pki.ca_crt), "certfile": str(self.pki.client_crt),
                "keyfile": str(self.pki.client_key), "check_hostname": True}

    def _client_reads(self, hosts: str, tls: bool) -> bool:
        from kazoo.client import KazooClient

        client = KazooClient(hosts=hosts, timeout=5.0, **(self.client_options() if tls else {}))
        try:
            client.start(timeout=2.0)
            client.get_children("/")
            return True
        except Exception:  # any failure here only means "not ready yet"
            return False
        finally:
            client.stop()
            client.close()

    def stop(self) -> list[ZooKeeperServer]:
        """Stop every member; the ones that were running."""
        return [member for member in self.members() if member.stop()]
