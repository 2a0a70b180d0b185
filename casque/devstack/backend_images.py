"""Build contexts for the images of the chart's own backends: casque-zookeeper, casque-cassandra.

The images run the same servers the local stack runs, started the same way: the jars that
`artifacts` resolves with Maven (strict checksums), the zoo.cfg and cassandra.yaml that
`ZooKeeperServer` and `CassandraNode` render, and the JVM options `CassandraNode` starts
Cassandra with. What differs in a pod is known only when the container starts (its address,
its ensemble or ring, its memory limit), so this module writes those settings as templates,
and a small bash script in the image fills them in from the environment, under /tmp (the root
filesystem is read-only), before it execs the JVM.

A context holds `lib/` (the jars), `conf/` (templates and logback.xml), `bin/` (the scripts)
and `SHA256SUMS` of every other file, which the Dockerfile checks after copying them in.
`casque dev image-context NAME DIR` writes one; the Dockerfiles (Dockerfile.zookeeper,
Dockerfile.cassandra at the top of the repository) are built with it as the context.
"""

from __future__ import annotations

import hashlib
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

from casque.devstack import artifacts
from casque.devstack.artifacts import CASSANDRA, ZOOKEEPER, MavenBundle
from casque.devstack.cassandra import JAVA17_MODULE_FLAGS, CassandraNode
from casque.devstack.processes import owner_marker
from casque.devstack.zookeeper import ZooKeeperServer
from casque.errors import StackError

ZOOKEEPER_HOME = Path("/opt/zookeeper")
CASSANDRA_HOME = Path("/opt/cassandra")
ZOOKEEPER_DATA = Path("/data")
ZOOKEEPER_LOGS = Path("/logs")
CASSANDRA_DATA = Path("/var/lib/cassandra")
CASSANDRA_LOGS = Path("/var/log/cassandra")
ZOOKEEPER_HEAP_MB = 256
SUMS = "SHA256SUMS"

# Each script's values come from the environment only through these bash variables, which
# the script checks before it uses them.
_SHELL_VARIABLES = ("${heap}", "${conf}", "${jmx_port}")


def _console(logback: str) -> str:
    """The same logback configuration, also writing to stdout, which `kubectl logs` shows."""
    console = ('  <appender name="STDOUT" class="ch.qos.logback.core.ConsoleAppender">\n'
               "    <encoder><pattern>%-5level [%thread] %date{ISO8601} %logger{20} - %msg%n</pattern></encoder>\n"
               "  </appender>\n")
    return (logback.replace("<configuration>\n", "<configuration>\n" + console, 1)
            .replace('<appender-ref ref="FILE"/>', '<appender-ref ref="FILE"/><appender-ref ref="STDOUT"/>'))


def _replace(text: str, old: str, new: str) -> str:
    """`text` with `old` replaced once: the devstack rendering it depends on must still hold it."""
    if text.count(old) != 1:
        raise StackError(f"the backend image templates expected {old!r} once in what casque.devstack renders")
    return text.replace(old, new)


def _shell_words(args: list[str]) -> str:
    """A bash array body, one argument a line: literals single-quoted, the arguments that
    name one of the script's variables double-quoted (and holding nothing else to expand)."""
    lines = []
    for arg in args:
        if any(variable in arg for variable in _SHELL_VARIABLES):
            rest = arg
            for variable in _SHELL_VARIABLES:
                rest = rest.replace(variable, "")
            if any(c in rest for c in '$`"\\'):
                raise StackError(f"cannot quote {arg!r} for the start script")
            lines.append(f'  "{arg}"')
        else:
            lines.append(f"  {shlex.quote(arg)}")
    return "\n".join(lines)


def _swapped(args: list[str], swaps: dict[str, str | None], source: str) -> list[str]:
    """`args` with each argument in `swaps` replaced by its value, or dropped for None. Every
    swap must find its argument: a devstack change that moves one must change the image too."""
    left = dict(swaps)
    out: list[str] = []
    for arg in args:
        if arg in left:
            new = left.pop(arg)
            if new is not None:
                out.append(new)
        else:
            out.append(arg)
    if left:
        raise StackError(f"{source} no longer has {sorted(left)}")
    return out


# --- ZooKeeper ---------------------------------------------------------------------------------


IMAGE_MAX_CLIENT_CONNECTIONS = 60


def zookeeper_zoo_cfg() -> str:
    """zoo.cfg without members: the start script adds `ZOO_SERVERS`' lines and the client port."""
    # Each pod has an address of its own: 60 connections (ZooKeeper's default cap) from one
    # is far more than a sidecar or the operator opens, and bounds a flood from one pod.
    server = ZooKeeperServer(Path("/nonexistent"), address="0.0.0.0",
                             max_client_connections=IMAGE_MAX_CLIENT_CONNECTIONS)
    text = server.render_zoo_cfg(data_dir=ZOOKEEPER_DATA)
    # Members bind their quorum and election ports on every address: a pod's name resolves to
    # its address only once the peers Service publishes it.
    return text + "quorumListenOnAllIPs=true\n"


ZOOKEEPER_RENDER = r"""#!/bin/bash
# Writes ZooKeeper's zoo.cfg from the environment (casque/devstack/backend_images.py made this).
#   ZOO_SERVERS      space-separated server.<id>=<host>:2888:3888;2181 lines; empty: standalone
#   ZOO_CLIENT_PORT  the client port (2181)
#   ZOO_CONF_DIR     where zoo.cfg goes (/tmp/zookeeper: the root filesystem is read-only)
#   ZOO_TLS_DIR      a directory with tls.crt, tls.key and ca.crt (PEM): clients then connect
#                    over TLS only, on ZOO_SECURE_CLIENT_PORT (2281); the plain client port
#                    listens on 127.0.0.1, for the readiness probe alone
#   ZOO_QUORUM_TLS   true: members talk to each other (quorum and election) over TLS, each
#                    presenting tls.crt to the others, checked against ca.crt; every member of
#                    the ensemble must agree (needs ZOO_TLS_DIR; false: plain text)
set -euo pipefail
home="${ZOO_HOME:-/opt/zookeeper}"
conf="${ZOO_CONF_DIR:-/tmp/zookeeper}"
data="${ZOO_DATA_DIR:-/data}"
port="${ZOO_CLIENT_PORT:-2181}"
tls_dir="${ZOO_TLS_DIR:-}"
secure_port="${ZOO_SECURE_CLIENT_PORT:-2281}"
quorum_tls="${ZOO_QUORUM_TLS:-false}"
fail() { echo "zookeeper: $*" >&2; exit 2; }
[[ $quorum_tls =~ ^(true|false)$ ]] || fail "ZOO_QUORUM_TLS is true or false: $quorum_tls"
[ "$quorum_tls" != true ] || [ -n "$tls_dir" ] || fail "ZOO_QUORUM_TLS=true needs ZOO_TLS_DIR"
[[ $port =~ ^[0-9]{1,5}$ ]] || fail "ZOO_CLIENT_PORT is not a port: $port"
[[ $secure_port =~ ^[0-9]{1,5}$ ]] || fail "ZOO_SECURE_CLIENT_PORT is not a port: $secure_port"
servers=()
for server in ${ZOO_SERVERS:-}; do
  [[ $server =~ ^server\.[0-9]+=[A-Za-z0-9._-]+:[0-9]+:[0-9]+(:(participant|observer))?(\;[0-9]+)?$ ]] \
    || fail "not a server.<id>=<host>:<quorum>:<election>;<client> line in ZOO_SERVERS: $server"
  # With TLS a member's plain client port is its own loopback's (a server line's client
  # address wins over clientPortAddress).
  [ -z "$tls_dir" ] || server="${server/;/;127.0.0.1:}"
  servers+=("$server")
done
mkdir -p "$conf"
tls=()
if [ -n "$tls_dir" ]; then
  for file in tls.crt tls.key ca.crt; do
    [ -r "$tls_dir/$file" ] || fail "ZOO_TLS_DIR=$tls_dir has no readable $file"
  done
  # ZooKeeper reads PKCS12 stores: made here from the PEM files, under a password made now,
  # in this container's scratch space (bin/stores).
  "$(dirname "$0")/stores" "$tls_dir" "$conf"
  tls=(
    "clientPortAddress=127.0.0.1"
    "secureClientPort=$secure_port"
    "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory"
    "ssl.keyStore.location=$conf/keystore.p12" "ssl.keyStore.type=PKCS12" "ssl.keyStore.passwordPath=$conf/store-password"
    "ssl.trustStore.location=$conf/truststore.p12" "ssl.trustStore.type=PKCS12"
    "ssl.trustStore.passwordPath=$conf/store-password"
    "ssl.clientAuth=none"
    # New stores (bin/start makes them when the PEM files change) are read without a restart.
    "client.certReload=true"
  )
  if [ "$quorum_tls" = true ]; then
    # The quorum's TLS: a member checks its peer's certificate against the CA, not its name
    # (a peer connects from its pod's address, which no certificate names).
    tls+=(
      "sslQuorum=true"
      "ssl.quorum.keyStore.location=$conf/keystore.p12" "ssl.quorum.keyStore.type=PKCS12"
      "ssl.quorum.keyStore.passwordPath=$conf/store-password"
      "ssl.quorum.trustStore.location=$conf/truststore.p12" "ssl.quorum.trustStore.type=PKCS12"
      "ssl.quorum.trustStore.passwordPath=$conf/store-password"
      "ssl.quorum.hostnameVerification=false"
      "sslQuorumReloadCertFiles=true"
    )
  fi
fi
if [ ${#servers[@]} -gt 0 ]; then
  # QuorumPeerMain reads the member's id from dataDir/myid (the chart's init container writes it).
  [[ -r $data/myid && $(<"$data/myid") =~ ^[0-9]+$ ]] || fail "ZOO_SERVERS lists members but $data/myid holds no id"
fi
{
  while IFS= read -r line; do
    case "$line" in
      clientPort=*) echo "clientPort=$port" ;;
      dataDir=*) echo "dataDir=$data" ;;
      *) printf '%s\n' "$line" ;;
    esac
  done <"$home/conf/zoo.cfg.in"
  for line in "${tls[@]}"; do printf '%s\n' "$line"; done
  for server in "${servers[@]}"; do printf '%s\n' "$server"; done
} >"$conf/zoo.cfg.partial"
mv "$conf/zoo.cfg.partial" "$conf/zoo.cfg"
echo "$conf/zoo.cfg"
"""

# Shared by both images: Java servers read key stores, Kubernetes Secrets hold PEM files.
STORES = r"""#!/bin/bash
# stores <pem-dir> <out-dir> [again]: <out-dir>/keystore.p12 (tls.key with tls.crt) and
# truststore.p12 (ca.crt) from the PEM files of <pem-dir>, both under the random password
# written to <out-dir>/store-password. The stores guard nothing the PEM files do not: the
# password only satisfies the store format (casque/devstack/backend_images.py made this).
# `again`: new stores from renewed PEM files under the password the server already holds,
# each moved into place whole, so that a server that watches them never reads half of one.
set -euo pipefail
pem="$1" out="$2" again="${3:-}"
umask 077
mkdir -p "$out"
if [ "$again" != again ] || [ ! -s "$out/store-password" ]; then
  head -c 24 /dev/urandom | base64 | tr -d '/+=\n' >"$out/store-password"
fi
password="$(<"$out/store-password")"
rm -f "$out/keystore.p12.new" "$out/truststore.p12.new"
openssl pkcs12 -export -in "$pem/tls.crt" -inkey "$pem/tls.key" -name server \
  -out "$out/keystore.p12.new" -passout "pass:$password"
# A trusted certificate entry, which only keytool writes in the form Java reads as trust.
keytool -importcert -noprompt -alias ca -file "$pem/ca.crt" -keystore "$out/truststore.p12.new" \
  -storetype PKCS12 -storepass "$password" >/dev/null
mv -f "$out/truststore.p12.new" "$out/truststore.p12"
mv -f "$out/keystore.p12.new" "$out/keystore.p12"
"""

# Started before the JVM takes the script's place: while the server runs, new stores whenever
# the mounted PEM files change (Kubernetes updates a mounted Secret in place: a renewal by
# cert-manager, or the chart's new certificate). {tls_dir} and {conf} are shell expressions,
# {reload} a command that makes the server read the new stores (tried again until it succeeds).
STORES_REFRESH = r"""
refresh_stores() {{
  local seen now
  seen="$(cat "{tls_dir}/tls.crt" "{tls_dir}/tls.key" "{tls_dir}/ca.crt" | openssl dgst -sha256)"
  while sleep "${{TLS_CHECK_SECONDS:-30}}"; do
    now="$(cat "{tls_dir}/tls.crt" "{tls_dir}/tls.key" "{tls_dir}/ca.crt" 2>/dev/null | openssl dgst -sha256)" \
      || continue
    [ "$now" != "$seen" ] || continue
    if "$(dirname "$0")/stores" "{tls_dir}" "{conf}" again && {reload}; then
      seen="$now"
      echo "stores: renewed certificate from {tls_dir} taken up" >&2
    fi
  done
}}
"""

ZOOKEEPER_SERVING = r"""#!/bin/bash
# Exits 0 when the server on 127.0.0.1 answers `srvr` with a serving mode: standalone, leader or
# follower. A member without a quorum answers no requests, and says so (no mode).
port="${ZOO_CLIENT_PORT:-2181}"
exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 1
printf 'srvr' >&3
while IFS= read -r -t 5 line <&3; do
  [[ $line =~ ^Mode:\ (standalone|leader|follower)$ ]] && exit 0
done
exit 1
"""


def zookeeper_start() -> str:
    # A member as devstack knows it, so that its JVM runs QuorumPeerMain, which serves alone
    # too when ZOO_SERVERS lists no members.
    server = ZooKeeperServer(Path("/nonexistent"), heap_mb=ZOOKEEPER_HEAP_MB, myid=1)
    d = server.directory.resolve()
    swaps: dict[str, str | None] = {
        "java": None,
        owner_marker(server.directory): None,
        f"-Xms{server.heap_mb}m": "-Xms${heap}m",
        f"-Xmx{server.heap_mb}m": "-Xmx${heap}m",
        f"-Dlogback.configurationFile={d}/logback.xml":
            f"-Dlogback.configurationFile={ZOOKEEPER_HOME}/conf/logback.xml",
        ZOOKEEPER.classpath(): f"{ZOOKEEPER_HOME}/lib/*",
        f"{d}/zoo.cfg": "${conf}/zoo.cfg",
    }
    args = _swapped(server.java_command(), swaps, "ZooKeeperServer.java_command()")
    # The JVM is the container's PID 1: out of memory, it must exit so that the pod restarts
    # rather than limp on.
    args.insert(args.index("-Xmx${heap}m") + 1, "-XX:+ExitOnOutOfMemoryError")
    # The root filesystem is read-only; /tmp is the container's scratch space.
    args.insert(args.index("-Dzookeeper.admin.enableServer=false") + 1, "-Djava.io.tmpdir=/tmp")
    return f"""#!/bin/bash
# Starts ZooKeeper: zoo.cfg from the environment, then the JVM in this process's place, so
# that it gets the container's signals. ZOO_HEAP_MB: the heap in MiB ({ZOOKEEPER_HEAP_MB}).
# ZOO_SUPER_USERNAME and ZOO_SUPER_PASSWORD: the installation's digest login, which then acts
# on every znode whatever its ACL (a client may create znodes naming only itself); the JVM
# gets its digest (base64 of SHA-1 of user:password, as ZooKeeper compares it), not the password.
set -euo pipefail
heap="${{ZOO_HEAP_MB:-{ZOOKEEPER_HEAP_MB}}}"
[[ $heap =~ ^[0-9]+$ ]] || {{ echo "zookeeper: ZOO_HEAP_MB is not a number: $heap" >&2; exit 2; }}
conf="${{ZOO_CONF_DIR:-/tmp/zookeeper}}"
"$(dirname "$0")/render-config" >/dev/null
args=(
{_shell_words(args)}
)
if [ -n "${{ZOO_SUPER_USERNAME:-}}" ]; then
  [ -n "${{ZOO_SUPER_PASSWORD:-}}" ] || {{ echo "zookeeper: ZOO_SUPER_USERNAME without ZOO_SUPER_PASSWORD" >&2; exit 2; }}
  digest="$(printf '%s:%s' "$ZOO_SUPER_USERNAME" "$ZOO_SUPER_PASSWORD" | openssl dgst -sha1 -binary | base64)"
  args=("-Dzookeeper.DigestAuthenticationProvider.superDigest=$ZOO_SUPER_USERNAME:$digest" "${{args[@]}}")
fi
unset ZOO_SUPER_PASSWORD
# The server reloads the stores it watches (client.certReload, sslQuorumReloadCertFiles).
{STORES_REFRESH.format(tls_dir="$ZOO_TLS_DIR", conf="$conf", reload=":")}
[ -z "${{ZOO_TLS_DIR:-}}" ] || refresh_stores &
exec java "${{args[@]}}"
"""


def write_zookeeper(context: Path) -> None:
    _copy_jars(ZOOKEEPER, context)
    server = ZooKeeperServer(Path("/nonexistent"))
    _write(context / "conf" / "zoo.cfg.in", zookeeper_zoo_cfg())
    _write(context / "conf" / "logback.xml", _console(server.render_logback(ZOOKEEPER_LOGS / "zookeeper.log")))
    _write(context / "bin" / "render-config", ZOOKEEPER_RENDER, executable=True)
    _write(context / "bin" / "stores", STORES, executable=True)
    _write(context / "bin" / "serving", ZOOKEEPER_SERVING, executable=True)
    _write(context / "bin" / "start", zookeeper_start(), executable=True)


# --- Cassandra ---------------------------------------------------------------------------------


def _cassandra_node() -> CassandraNode:
    # Placeholders the render script replaces; a datacenter selects GossipingPropertyFileSnitch,
    # whose line is replaced by CASSANDRA_ENDPOINT_SNITCH.
    return CassandraNode(CASSANDRA_DATA, address="@ADDRESS@", seeds="@SEEDS@", cluster_name="@CLUSTER_NAME@",
                         datacenter="@DC@")


def cassandra_yaml() -> str:
    node = _cassandra_node()
    text = node.render_yaml()
    text = _replace(text, f'seeds: "@SEEDS@:{node.storage_port}"', 'seeds: "@SEEDS@"')
    text = _replace(text, "cluster_name: @CLUSTER_NAME@", "cluster_name: '@CLUSTER_NAME@'")
    text = _replace(text, "endpoint_snitch: GossipingPropertyFileSnitch", "endpoint_snitch: @SNITCH@")
    text = _replace(text, "authenticator: AllowAllAuthenticator", "authenticator: @AUTHENTICATOR@")
    text = _replace(text, "authorizer: AllowAllAuthorizer", "authorizer: @AUTHORIZER@")
    # The local stack's rings are fresh; a pod may join a ring that holds data, which it must
    # stream to itself before it serves.
    text = _replace(text, "# A fresh local ring has no data to stream, so joining nodes skip bootstrap.\n"
                          "auto_bootstrap: false\n", "auto_bootstrap: true\n")
    return text


def cassandra_start() -> str:
    node = _cassandra_node()
    d = CASSANDRA_DATA
    lib = CASSANDRA_HOME / "lib"
    args = node.java_command()
    swaps: dict[str, str | None] = {
        "java": None,
        owner_marker(node.directory): None,
        f"-Xms{node.heap_mb}m": "-Xms${heap}",
        f"-Xmx{node.heap_mb}m": "-Xmx${heap}",
        f"-javaagent:{CASSANDRA.jar('jamm')}": f"-javaagent:{lib}/{CASSANDRA.jar('jamm').name}",
        f"-Dcassandra.config=file://{d}/cassandra.yaml": "-Dcassandra.config=file://${conf}/cassandra.yaml",
        f"-Dcassandra-rackdc.properties=file://{d}/cassandra-rackdc.properties":
            "-Dcassandra-rackdc.properties=file://${conf}/cassandra-rackdc.properties",
        f"-Dcassandra.logdir={d}/logs": f"-Dcassandra.logdir={CASSANDRA_LOGS}",
        f"-Dlogback.configurationFile={d}/logback.xml": f"-Dlogback.configurationFile={CASSANDRA_HOME}/conf/logback.xml",
        f"-Dcassandra.jmx.local.port={node.jmx_port}": "-Dcassandra.jmx.local.port=${jmx_port}",
        # A joining node waits the ring delay for the ring's news; the local stack's fresh rings
        # need not, a pod joining a ring in service does.
        "-Dcassandra.ring_delay_ms=1000": None,
        CASSANDRA.classpath(): f"{lib}/*",
    }
    out = _swapped(args, swaps, "CassandraNode.java_command()")
    out.insert(out.index("-XX:+ExitOnOutOfMemoryError") + 1, "-Djava.io.tmpdir=/tmp")
    return f"""#!/bin/bash
# Starts a Cassandra node: cassandra.yaml and cassandra-rackdc.properties from the environment
# (bin/render-config), then the JVM in this process's place, so that it gets the container's
# SIGTERM and drains on it.
set -euo pipefail
conf="${{CASSANDRA_CONF_DIR:-/tmp/cassandra}}"
jmx_port="${{CASSANDRA_JMX_PORT:-7199}}"
[[ $jmx_port =~ ^[0-9]{{1,5}}$ ]] || {{ echo "cassandra: CASSANDRA_JMX_PORT is not a port: $jmx_port" >&2; exit 2; }}
"$(dirname "$0")/render-config"
heap="$(<"$conf/heap")"
args=(
{_shell_words(out)}
)
# Cassandra looks at its stores' files by itself only every ten minutes: `nodetool reloadssl`
# makes it read them now, for clients and peers alike.
{STORES_REFRESH.format(tls_dir="$CASSANDRA_TLS_DIR", conf="$conf",
                       reload='"$(dirname "$0")/nodetool" reloadssl')}
[ -z "${{CASSANDRA_TLS_DIR:-}}" ] || refresh_stores &
exec java "${{args[@]}}"
"""


def cassandra_nodetool() -> str:
    return f"""#!/bin/bash
# nodetool against this container's node, through JMX on 127.0.0.1 (CASSANDRA_JMX_PORT), in a
# JVM of its own kept small beside the node's.
set -euo pipefail
exec java -Xmx128m {" ".join(shlex.quote(flag) for flag in JAVA17_MODULE_FLAGS)} \
  -Dlogback.configurationFile={CASSANDRA_HOME}/conf/logback-tools.xml -cp "{CASSANDRA_HOME / "lib"}/*" \
  org.apache.cassandra.tools.NodeTool -h 127.0.0.1 -p "${{CASSANDRA_JMX_PORT:-7199}}" "$@"
"""


CASSANDRA_RENDER = r"""#!/bin/bash
# Writes cassandra.yaml and cassandra-rackdc.properties from the environment, and the heap
# into `heap` beside them (casque/devstack/backend_images.py made this):
#   CASSANDRA_CLUSTER_NAME     (casque)
#   CASSANDRA_LISTEN_ADDRESS   this node's address (default: what the container's host name resolves to)
#   CASSANDRA_SEEDS            comma-separated addresses (default: this node)
#   CASSANDRA_DC, CASSANDRA_RACK  (dc1, rack1), for GossipingPropertyFileSnitch
#   CASSANDRA_ENDPOINT_SNITCH  (GossipingPropertyFileSnitch)
#   CASSANDRA_AUTHENTICATOR    (PasswordAuthenticator: logins are checked; its default superuser
#                              cassandra/cassandra exists until whoever sets the node up replaces it)
#   CASSANDRA_AUTHORIZER       (CassandraAuthorizer: grants are checked)
#   MAX_HEAP_SIZE              e.g. 1024M (default: half the cgroup's memory limit, at most 8G)
#   CASSANDRA_CONF_DIR         where the files go (/tmp/cassandra: the root filesystem is read-only)
#   CASSANDRA_TLS_DIR          a directory with tls.crt, tls.key and ca.crt (PEM): CQL then
#                              speaks TLS only
#   CASSANDRA_INTERNODE_TLS    true: the nodes' own traffic too (gossip, streaming, mutations),
#                              each presenting tls.crt to its peers, checked against ca.crt;
#                              every node of a ring must agree (false: plain text)
set -euo pipefail
home="${CASSANDRA_HOME:-/opt/cassandra}"
conf="${CASSANDRA_CONF_DIR:-/tmp/cassandra}"
# cgroup v2's limit, else v1's.
limits="${CASSANDRA_MEMORY_LIMIT_FILES:-/sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes}"
meminfo="${CASSANDRA_MEMINFO:-/proc/meminfo}"
fail() { echo "cassandra: $*" >&2; exit 2; }

default_heap() {
  local limit="" file key value unit
  for file in $limits; do
    if [ -r "$file" ]; then limit="$(<"$file")"; break; fi
  done
  # No limit: v2 says "max", v1 a number near 2^63. Then the machine's memory is the limit.
  if ! [[ $limit =~ ^[0-9]+$ ]] || [ "${#limit}" -gt 15 ]; then
    limit=""
    while read -r key value unit; do
      [ "$key" = "MemTotal:" ] && limit=$((value * 1024))
    done <"$meminfo"
    [ -n "$limit" ] || fail "no memory limit in $limits and no MemTotal in $meminfo; set MAX_HEAP_SIZE"
  fi
  local mb=$((limit / 2 / 1048576))
  [ "$mb" -le 8192 ] || mb=8192
  # Below this Cassandra does not start: a smaller limit gets what it needs and may be killed.
  [ "$mb" -ge 256 ] || mb=256
  echo "${mb}M"
}

own_address() {
  local address rest
  read -r address rest < <(getent ahostsv4 "$HOSTNAME" || true) || true
  [ -n "${address:-}" ] || fail "$HOSTNAME has no IPv4 address; set CASSANDRA_LISTEN_ADDRESS"
  echo "$address"
}

cluster="${CASSANDRA_CLUSTER_NAME:-casque}"
listen="${CASSANDRA_LISTEN_ADDRESS:-}"
[ -n "$listen" ] || listen="$(own_address)"
seeds="${CASSANDRA_SEEDS:-$listen}"
dc="${CASSANDRA_DC:-dc1}"
rack="${CASSANDRA_RACK:-rack1}"
snitch="${CASSANDRA_ENDPOINT_SNITCH:-GossipingPropertyFileSnitch}"
authenticator="${CASSANDRA_AUTHENTICATOR:-PasswordAuthenticator}"
authorizer="${CASSANDRA_AUTHORIZER:-CassandraAuthorizer}"
heap="${MAX_HEAP_SIZE:-$(default_heap)}"
internode_tls="${CASSANDRA_INTERNODE_TLS:-false}"

# What goes into YAML unquoted or single-quoted must not end or extend the value.
[[ $cluster =~ ^[A-Za-z0-9._\ -]+$ ]] || fail "CASSANDRA_CLUSTER_NAME may hold letters, digits, '.', '_', '-' and spaces: $cluster"
[[ $listen =~ ^[A-Za-z0-9.:_-]+$ ]] || fail "CASSANDRA_LISTEN_ADDRESS is not an address: $listen"
[[ $seeds =~ ^[A-Za-z0-9.:_-]+(,[A-Za-z0-9.:_-]+)*$ ]] || fail "CASSANDRA_SEEDS is not a comma-separated list of addresses: $seeds"
[[ $dc =~ ^[A-Za-z0-9._-]+$ ]] || fail "CASSANDRA_DC may hold letters, digits, '.', '_' and '-': $dc"
[[ $rack =~ ^[A-Za-z0-9._-]+$ ]] || fail "CASSANDRA_RACK may hold letters, digits, '.', '_' and '-': $rack"
[[ $snitch =~ ^[A-Za-z0-9.]+$ ]] || fail "CASSANDRA_ENDPOINT_SNITCH is not a class name: $snitch"
[[ $authenticator =~ ^[A-Za-z0-9.]+$ ]] || fail "CASSANDRA_AUTHENTICATOR is not a class name: $authenticator"
[[ $authorizer =~ ^[A-Za-z0-9.]+$ ]] || fail "CASSANDRA_AUTHORIZER is not a class name: $authorizer"
[[ $heap =~ ^[0-9]+[MmGg]$ ]] || fail "MAX_HEAP_SIZE is not a size like 1024M or 2G: $heap"
[[ $internode_tls =~ ^(true|false)$ ]] || fail "CASSANDRA_INTERNODE_TLS is true or false: $internode_tls"

template="$(<"$home/conf/cassandra.yaml.in")"
# Quoted replacements: bash 5.2 would otherwise read '&' in them as the match.
template="${template//@CLUSTER_NAME@/"$cluster"}"
template="${template//@ADDRESS@/"$listen"}"
template="${template//@SEEDS@/"$seeds"}"
template="${template//@SNITCH@/"$snitch"}"
template="${template//@AUTHENTICATOR@/"$authenticator"}"
template="${template//@AUTHORIZER@/"$authorizer"}"
mkdir -p "$conf"
tls_dir="${CASSANDRA_TLS_DIR:-}"
if [ -n "$tls_dir" ]; then
  for file in tls.crt tls.key ca.crt; do
    [ -r "$tls_dir/$file" ] || fail "CASSANDRA_TLS_DIR=$tls_dir has no readable $file"
  done
  # Cassandra reads PKCS12 stores: made here from the PEM files, under a password made now.
  "$(dirname "$0")/stores" "$tls_dir" "$conf"
  password="$(<"$conf/store-password")"
  # The same stores for clients and, with CASSANDRA_INTERNODE_TLS, for peers.
  stores="
  keystore: $conf/keystore.p12
  keystore_password: \"$password\"
  truststore: $conf/truststore.p12
  truststore_password: \"$password\"
  store_type: PKCS12"
  template+="
client_encryption_options:
  enabled: true
  optional: false$stores
  require_client_auth: false"
fi
if [ "$internode_tls" = true ]; then
  [ -n "$tls_dir" ] || fail "CASSANDRA_INTERNODE_TLS=true needs CASSANDRA_TLS_DIR"
  template+="
server_encryption_options:
  internode_encryption: all
  legacy_ssl_storage_port_enabled: false$stores
  require_client_auth: true
  require_endpoint_verification: false"
fi
printf '%s\n' "$template" >"$conf/cassandra.yaml"
printf 'dc=%s\nrack=%s\n' "$dc" "$rack" >"$conf/cassandra-rackdc.properties"
printf '%s\n' "$heap" >"$conf/heap"
cql="CQL in plain text"
[ -z "$tls_dir" ] || cql="CQL over TLS only"
internode="internode traffic in plain text"
[ "$internode_tls" != true ] || internode="internode traffic over TLS"
echo "cassandra: cluster '$cluster', listening on $listen, seeds $seeds, $dc/$rack ($snitch), heap $heap, $authenticator, $authorizer, $cql, $internode" >&2
"""


def write_cassandra(context: Path) -> None:
    _copy_jars(CASSANDRA, context)
    node = _cassandra_node()
    logback = _replace(node.render_logback(), str(node.log_path.resolve()), str(CASSANDRA_LOGS / "system.log"))
    _write(context / "conf" / "cassandra.yaml.in", cassandra_yaml())
    _write(context / "conf" / "logback.xml", _console(logback))
    _write(context / "bin" / "render-config", CASSANDRA_RENDER, executable=True)
    _write(context / "bin" / "stores", STORES, executable=True)
    _write(context / "bin" / "start", cassandra_start(), executable=True)
    _write(context / "bin" / "nodetool", cassandra_nodetool(), executable=True)
    _write(context / "conf" / "logback-tools.xml", '<configuration><root level="WARN"/></configuration>\n')


# --- the context -------------------------------------------------------------------------------


WRITERS: dict[str, tuple[MavenBundle, Callable[[Path], None]]] = {
    "zookeeper": (ZOOKEEPER, write_zookeeper),
    "cassandra": (CASSANDRA, write_cassandra),
}


def _write(path: Path, text: str, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755 if executable else 0o644)


def _copy_jars(bundle: MavenBundle, context: Path) -> None:
    lib = context / "lib"
    lib.mkdir(parents=True)
    for jar in sorted(bundle.lib_dir.glob("*.jar")):
        shutil.copyfile(jar, lib / jar.name)
        (lib / jar.name).chmod(0o644)


def sha256sums(context: Path) -> str:
    """`sha256sum` lines of every file in `context` but SHA256SUMS, sorted by path."""
    lines = []
    for path in sorted(p for p in context.rglob("*") if p.is_file() and p.name != SUMS):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        lines.append(f"{digest}  {path.relative_to(context).as_posix()}\n")
    return "".join(lines)


def write_context(name: str, context: Path) -> Path:
    """Write the build context of the image `name` (zookeeper or cassandra) into `context`,
    which must be empty or absent; the jars are resolved first if the cache lacks them."""
    if name not in WRITERS:
        raise StackError(f"unknown backend image {name!r}; one of: {', '.join(WRITERS)}")
    if context.exists() and any(context.iterdir()):
        raise StackError(f"{context} is not empty")
    bundle, write = WRITERS[name]
    artifacts.ensure_bundle(bundle)
    context.mkdir(parents=True, exist_ok=True)
    write(context)
    (context / SUMS).write_text(sha256sums(context))
    return context
