"""One Cassandra 5.0 node of the local stack: its configuration, start, readiness and nodetool.

Sized for a small machine (2 cores): a 1-2 GiB heap, few compaction and I/O threads, and
loopback addresses only. A ring of N nodes uses 127.0.0.1..N on the same ports, which Linux
accepts because the whole 127.0.0.0/8 range is loopback.

A node with a `datacenter` uses GossipingPropertyFileSnitch and announces that datacenter
(and rack1) from its cassandra-rackdc.properties; without one, SimpleSnitch, whose single
datacenter is called datacenter1.

With `pki` the CQL port speaks TLS only (client_encryption_options, PKCS12 stores), and with
`require_client_auth` it refuses clients without a certificate the stack's CA signed. With
`password_auth` it runs PasswordAuthenticator and CassandraAuthorizer, so that grants are
enforced (keyspace isolation). Its default superuser, cassandra/cassandra, lives only until
the stack's `up` has made the installation's login (`CassandraLogin`) and disabled it, as
`casque secure-cassandra` does for the chart's ring; the stack's own checks log in as the
installation once its password exists, as the default superuser before.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from casque.devstack import processes
from casque.devstack.artifacts import CASSANDRA
from casque.devstack.jvm import compiler_flags
from casque.devstack.pki import LocalPki
from casque.devstack.zookeeper import write_private
from casque.errors import StackError

# Java 17 module openings that Cassandra 5.0 needs (the same list its own launcher passes).
JAVA17_MODULE_FLAGS = [
    "-Djdk.attach.allowAttachSelf=true",
    "--add-exports", "java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-exports", "java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED",
    "--add-exports", "java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports", "java.rmi/sun.rmi.server=ALL-UNNAMED",
    "--add-exports", "java.sql/java.sql=ALL-UNNAMED",
    "--add-exports", "java.base/java.lang.ref=ALL-UNNAMED",
    "--add-exports", "jdk.unsupported/sun.misc=ALL-UNNAMED",
    "--add-exports", "jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED",
    "--add-exports", "jdk.attach/sun.tools.attach=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang.module=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.loader=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.reflect=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.math=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.module=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.util.jar=ALL-UNNAMED",
    "--add-opens", "jdk.management/com.sun.management.internal=ALL-UNNAMED",
    "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens", "java.base/java.io=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens", "jdk.compiler/com.sun.tools.javac=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang=ALL-UNNAMED",
    "--add-opens", "java.base/java.util=ALL-UNNAMED",
    "-Dio.netty.tryReflectionSetAccessible=true",
]

# A node that lives for minutes does not flush the system tables at each schema change or
# TRUNCATE (what Cassandra's own tests run with): the test suite makes, empties and drops
# tables by the thousand, and each one flushed system.local or every schema table. The
# commit log still holds them, and a node stopped by SIGTERM flushes everything as it drains;
# one killed instead could replay rows a TRUNCATE removed, as the truncation's record is not
# yet on disk for the replay to read.
SHORT_LIVED_FLAGS = ("-Dcassandra.unsafesystem=true",)


# PasswordAuthenticator's default superuser. For the local stack's own checks only: casque
# refuses a password this short, so clients log in as INSTALLATION_USER (CassandraLogin).
DEFAULT_SUPERUSER = ("cassandra", "cassandra")
INSTALLATION_USER = "casque"


@dataclass(frozen=True)
class CassandraLogin:
    """The installation's Cassandra login on a stack with `password_auth`: a superuser role of
    its own whose password is made on first use and kept in `password_file` (mode 0600), so a
    restarted stack keeps it."""

    password_file: Path
    username: str = INSTALLATION_USER

    def ensure(self) -> None:
        if not self.password_file.exists():
            write_private(self.password_file, secrets.token_urlsafe(32) + "\n")

    def password(self) -> str:
        return self.password_file.read_text().strip()


@dataclass(frozen=True)
class CassandraNode:
    """Where one node lives and listens."""

    directory: Path
    address: str = "127.0.0.1"
    native_port: int = 9042
    storage_port: int = 7000
    jmx_port: int = 7199
    seeds: str = "127.0.0.1"
    cluster_name: str = "casque-dev"
    heap_mb: int = 1536
    datacenter: str | None = None
    pki: LocalPki | None = None
    require_client_auth: bool = False
    password_auth: bool = False
    # The installation's login (with `password_auth`), tried before the default superuser.
    login: CassandraLogin | None = None
    # A node that lives for minutes (casque.devstack.jvm): its JVM compiles with C1 only, and
    # it writes its schema without flushing it (SHORT_LIVED_FLAGS).
    short_lived: bool = False

    @property
    def snitch(self) -> str:
        return "SimpleSnitch" if self.datacenter is None else "GossipingPropertyFileSnitch"

    @property
    def log_path(self) -> Path:
        return self.directory / "logs" / "system.log"

    @property
    def stdout_path(self) -> Path:
        return self.directory / "stdout.log"

    def render_yaml(self) -> str:
        d = self.directory.resolve()
        seeds = ",".join(f"{seed}:{self.storage_port}" for seed in self.seeds.split(","))
        return f"""\
cluster_name: {self.cluster_name}
num_tokens: 16
partitioner: org.apache.cassandra.dht.Murmur3Partitioner
data_file_directories: [{d}/data]
commitlog_directory: {d}/commitlog
saved_caches_directory: {d}/saved_caches
hints_directory: {d}/hints
cdc_raw_directory: {d}/cdc_raw
commitlog_sync: periodic
commitlog_sync_period: 10000ms
seed_provider:
  - class_name: org.apache.cassandra.locator.SimpleSeedProvider
    parameters:
      - seeds: "{seeds}"
listen_address: {self.address}
rpc_address: {self.address}
storage_port: {self.storage_port}
native_transport_port: {self.native_port}
start_native_transport: true
endpoint_snitch: {self.snitch}
# A fresh local ring has no data to stream, so joining nodes skip bootstrap.
auto_bootstrap: false
authenticator: {"PasswordAuthenticator" if self.password_auth else "AllowAllAuthenticator"}
# With passwords, grants are checked too: a namespace's role reaches its own keyspace only.
authorizer: {"CassandraAuthorizer" if self.password_auth else "AllowAllAuthorizer"}
concurrent_reads: 8
concurrent_writes: 16
concurrent_counter_writes: 4
concurrent_compactors: 1
memtable_heap_space: 256MiB
memtable_offheap_space: 256MiB
auto_snapshot: false
materialized_views_enabled: false
# Paxos v2 needs about half the round trips of v1 for a conditional write; casque claims
# every batch with one.
paxos_variant: v2
# Guardrails, for every role but superusers (the installation's login): a namespace's role
# may write its own keyspace's rows directly, so no value past 2 MiB (the largest casque
# writes is a message, 1 MiB at most), and no time-windowed table whose rows never expire.
# (The zero-TTL guardrail of 5.0 covers a table's default only: a write `USING TTL 0` still
# passes, docs/security.md.)
zero_ttl_on_twcs_enabled: false
column_value_size_fail_threshold: 2MiB
{self._render_client_encryption()}"""

    def _render_client_encryption(self) -> str:
        if self.pki is None:
            return ""
        stores = self.pki.stores
        # The same stores for clients and peers, indented under either section.
        keys = (f"  keystore: {stores.keystore.resolve()}\n  keystore_password: \"{stores.password}\"\n"
                f"  truststore: {stores.truststore.resolve()}\n  truststore_password: \"{stores.password}\"\n"
                "  store_type: PKCS12\n")
        return f"""client_encryption_options:
  enabled: true
  optional: false
{keys}  require_client_auth: {str(self.require_client_auth).lower()}
# Between the nodes too: gossip, streaming and mutations, each node checking its peer's
# certificate against the CA (not its name: a node's address is not known in advance).
server_encryption_options:
  internode_encryption: all
  legacy_ssl_storage_port_enabled: false
{keys}  require_client_auth: true
  require_endpoint_verification: false
"""

    def render_rackdc(self) -> str:
        """cassandra-rackdc.properties: where GossipingPropertyFileSnitch says this node is."""
        return f"dc={self.datacenter}\nrack=rack1\n"

    def render_logback(self) -> str:
        return f"""<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>{self.log_path.resolve()}</file>
    <encoder><pattern>%-5level [%thread] %date{{ISO8601}} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
"""

    def write_config(self) -> None:
        for sub in ("data", "commitlog", "saved_caches", "hints", "cdc_raw", "logs"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        (self.directory / "cassandra.yaml").write_text(self.render_yaml())
        (self.directory / "logback.xml").write_text(self.render_logback())
        if self.datacenter is not None:
            (self.directory / "cassandra-rackdc.properties").write_text(self.render_rackdc())

    def java_command(self) -> list[str]:
        d = self.directory.resolve()
        return [
            "java",
            processes.owner_marker(self.directory),
            f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m",
            "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=300", "-Xss512k",
            *compiler_flags(self.short_lived),
            *(SHORT_LIVED_FLAGS if self.short_lived else ()),
            "-XX:+ExitOnOutOfMemoryError",
            f"-javaagent:{CASSANDRA.jar('jamm')}",
            *JAVA17_MODULE_FLAGS,
            f"-Dcassandra.config=file://{d}/cassandra.yaml",
            *self._snitch_flags(),
            f"-Dcassandra.storagedir={d}",
            f"-Dcassandra.logdir={d}/logs",
            f"-Dlogback.configurationFile={d}/logback.xml",
            f"-Dcassandra.jmx.local.port={self.jmx_port}",
            "-Dcassandra-foreground=yes",
            # A single node, or a ring of fresh nodes, has nothing to wait for.
            "-Dcassandra.skip_wait_for_gossip_to_settle=0",
            "-Dcassandra.ring_delay_ms=1000",
            # PasswordAuthenticator creates its default superuser this long after startup.
            "-Dcassandra.superuser_setup_delay_ms=0",
            "-cp", CASSANDRA.classpath(),
            "org.apache.cassandra.service.CassandraDaemon",
        ]

    def _snitch_flags(self) -> list[str]:
        if self.datacenter is None:
            return []
        # GossipingPropertyFileSnitch looks for its file on the classpath unless told where.
        return [f"-Dcassandra-rackdc.properties=file://{self.directory.resolve()}/cassandra-rackdc.properties"]

    def start(self) -> int:
        self.write_config()
        processes.rotate(self.log_path)
        return processes.spawn(self.directory, self.java_command(), "stdout.log")

    def pid(self) -> int | None:
        return processes.running_pid(self.directory)

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Wait until the node answers a CQL query; fail fast if the process died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid() is None:
                raise StackError(self._failure("exited during startup"))
            if self._cql_answers():
                return
            time.sleep(0.5)
        raise StackError(self._failure(f"did not answer CQL within {timeout:.0f}s"))

    def _failure(self, what: str) -> str:
        errors = [line for line in processes.log_tail(self.log_path, 400) if "ERROR" in line]
        reason = errors[-1].strip() if errors else "no ERROR line in the log"
        return f"Cassandra {self.address}:{self.native_port} {what}: {reason} (log: {self.log_path})"

    def _cql_answers(self) -> bool:
        try:
            with socket.create_connection((self.address, self.native_port), timeout=1.0):
                pass
        except OSError:
            return False
        return self._query_alone("SELECT release_version FROM system.local") is not None

    def driver_peers(self) -> set[str]:
        """The other nodes this node describes well enough for a driver to use them: a driver
        whose control connection lands here drops a peer whose row lacks its host id,
        datacenter, rack, address or tokens, which a node that just joined may not have yet."""
        rows = self._query_alone("SELECT host_id, data_center, rack, native_address, tokens FROM system.peers_v2")
        return {
            str(row.native_address) for row in rows or []
            if row.host_id and row.data_center and row.rack and row.native_address and row.tokens
        }

    def _query_alone(self, query: str) -> list[Any] | None:
        """The rows of `query` asked of this node only (in a ring, "ready" is per node);
        None when it does not answer (any failure here only means "not ready yet")."""
        from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
        from cassandra.policies import WhiteListRoundRobinPolicy

        only_this = ExecutionProfile(load_balancing_policy=WhiteListRoundRobinPolicy([self.address]))
        for credentials in self._logins():
            cluster = Cluster(
                [self.address], port=self.native_port, connect_timeout=5,
                execution_profiles={EXEC_PROFILE_DEFAULT: only_this}, **self.client_options(credentials),
            )
            try:
                return list(cluster.connect().execute(query))
            except Exception:
                continue
            finally:
                cluster.shutdown()
        return None

    def _logins(self) -> list[tuple[str, str] | None]:
        """Who the stack's own checks log in as: the installation once its password is made
        (the default superuser is disabled after that), the default superuser until then."""
        if not self.password_auth:
            return [None]
        made = self.login is not None and self.login.password_file.exists()
        return [*([(self.login.username, self.login.password())] if made and self.login else []), DEFAULT_SUPERUSER]

    def client_options(self, credentials: tuple[str, str] | None = None) -> dict[str, Any]:
        """What a driver Cluster needs to reach this node: TLS with the stack's CA (and its
        client certificate), and `credentials` to log in with."""
        options: dict[str, Any] = {}
        if self.pki is not None:
            options["ssl_context"] = self.pki.client_context()
        if credentials is not None:
            from cassandra.auth import PlainTextAuthProvider

            options["auth_provider"] = PlainTextAuthProvider(*credentials)
        return options

    def run_tool(self, main_class: str, *args: str, timeout: float = 120.0) -> str:
        """Run one of Cassandra's command line tools (nodetool, sstabledump, ...) against this node."""
        tools_log = self.directory / "logback-tools.xml"
        if not tools_log.exists():
            tools_log.write_text("<configuration><root level=\"WARN\"/></configuration>\n")
        command = [
            "java", *JAVA17_MODULE_FLAGS,
            f"-Dcassandra.storagedir={self.directory.resolve()}",
            f"-Dcassandra.config=file://{self.directory.resolve()}/cassandra.yaml",
            f"-Dlogback.configurationFile={tools_log.resolve()}",
            "-cp", CASSANDRA.classpath(),
            main_class, *args,
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            name = main_class.rsplit(".", 1)[-1]
            raise StackError(f"{name} {' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    def nodetool(self, *args: str, timeout: float = 120.0) -> str:
        return self.run_tool(
            "org.apache.cassandra.tools.NodeTool", "-h", "127.0.0.1", "-p", str(self.jmx_port), *args, timeout=timeout
        )

    def sstables(self, keyspace: str, table: str) -> list[Path]:
        """The data files of a table on this node (after `nodetool flush`)."""
        return sorted((self.directory / "data" / keyspace).glob(f"{table}-*/*-Data.db"))

    def sstabledump(self, data_file: Path) -> str:
        return self.run_tool("org.apache.cassandra.tools.SSTableExport", str(data_file))

    def stop(self) -> bool:
        return processes.terminate(self.directory)
