"""The backends' images (Dockerfile.zookeeper, Dockerfile.cassandra) and the build contexts that
`casque dev image-context` stages for them: what the Dockerfiles copy is there, SHA256SUMS
holds, the scripts parse, and the render scripts, run here on the host in a temporary
directory, write the configuration the environment asks for.

The jars come from the cache that `casque dev install` fills (the integration tests' session
does too); without them the context cannot be staged and the tests say so.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from casque.devstack import backend_images
from casque.devstack.artifacts import CASSANDRA, ZOOKEEPER
from casque.devstack.pki import issue_cert, make_ca
from casque.errors import StackError
from tests.unit.test_dockerfiles import env_of, only, parse

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: ROOT / f"Dockerfile.{name}" for name in backend_images.WRITERS}
HOMES = {"zookeeper": "/opt/zookeeper", "cassandra": "/opt/cassandra"}
VOLUMES = {"zookeeper": ["/data", "/logs", "/tmp"], "cassandra": ["/var/lib/cassandra", "/var/log/cassandra", "/tmp"]}


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    for bundle in (ZOOKEEPER, CASSANDRA):
        if not (bundle.lib_dir.parent / "complete").exists():
            pytest.fail(f"{bundle.name} is not in the cache: run `.venv/bin/casque dev install`")
    root = tmp_path_factory.mktemp("contexts")
    return {name: backend_images.write_context(name, root / name) for name in backend_images.WRITERS}


# --- the context ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", backend_images.WRITERS)
def test_the_context_holds_the_bundles_jars_and_sums_that_match(contexts: dict[str, Path], name: str) -> None:
    context = contexts[name]
    bundle = backend_images.WRITERS[name][0]
    assert sorted(p.name for p in (context / "lib").iterdir()) == sorted(p.name for p in bundle.lib_dir.glob("*.jar"))
    listed = {}
    for line in (context / backend_images.SUMS).read_text().splitlines():
        digest, path = line.split("  ", 1)
        listed[path] = digest
    files = {p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file()} - {backend_images.SUMS}
    assert set(listed) == files
    for path, digest in listed.items():
        assert hashlib.sha256((context / path).read_bytes()).hexdigest() == digest, path
    # And the tool the Dockerfile runs agrees.
    subprocess.run(["sha256sum", "--check", "--strict", "--quiet", backend_images.SUMS], cwd=context, check=True)


def test_a_context_is_written_into_an_empty_directory_only(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    with pytest.raises(StackError, match="not empty"):
        backend_images.write_context("zookeeper", tmp_path)
    with pytest.raises(StackError, match="unknown backend image"):
        backend_images.write_context("kafka", tmp_path / "new")


@pytest.mark.parametrize("name", backend_images.WRITERS)
def test_the_scripts_parse_and_are_executable(contexts: dict[str, Path], name: str) -> None:
    scripts = sorted((contexts[name] / "bin").iterdir())
    expected = {"render-config", "start", "stores"} | ({"serving"} if name == "zookeeper" else {"nodetool"})
    assert {p.name for p in scripts} == expected
    for script in scripts:
        assert os.access(script, os.X_OK), script
        assert script.read_text().startswith("#!/bin/bash\n")
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, (script, result.stderr)


# --- the Dockerfiles -----------------------------------------------------------------------------


def test_hadolint_finds_nothing_in_the_backends_dockerfiles() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), "--no-color", *map(str, DOCKERFILES.values())],
                            capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", backend_images.WRITERS)
def test_the_dockerfile_copies_the_context_checks_it_and_runs_as_10001(contexts: dict[str, Path], name: str) -> None:
    instructions = parse(DOCKERFILES[name])
    assert only(instructions, "FROM").args == "${BASE_IMAGE}"
    home = HOMES[name]
    assert only(instructions, "COPY").args == f". {home}/"
    # The context is copied whole into the home; the sums are checked there, after the copy.
    names = [i.name for i in instructions]
    check = next(i for i in instructions if i.name == "RUN" and "sha256sum" in i.args)
    assert names.index("COPY") < instructions.index(check)
    assert check.args.startswith(f"sha256sum --check --strict --quiet {backend_images.SUMS}")
    workdirs = [i.args for i in instructions[: instructions.index(check)] if i.name == "WORKDIR"]
    assert workdirs[-1] == home
    assert (contexts[name] / backend_images.SUMS).is_file()
    # Java from Debian's openjdk-17 package.
    (install,) = [i for i in instructions if i.name == "RUN" and "apt-get install" in i.args]
    assert "openjdk-17-jre-headless" in install.args
    assert only(instructions, "USER").args == "10001:10001"
    assert only(instructions, "VOLUME").exec_form() == VOLUMES[name]
    assert env_of(instructions)["HOME"] == "/tmp"
    entrypoint = only(instructions, "ENTRYPOINT").exec_form()
    assert entrypoint == [f"{home}/bin/start"]
    assert (contexts[name] / "bin" / "start").is_file()


# --- ZooKeeper's configuration ---------------------------------------------------------------------


def render_zookeeper(context: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    base = {"PATH": os.environ["PATH"], "ZOO_HOME": str(context), "ZOO_CONF_DIR": str(tmp_path / "conf"),
            "ZOO_DATA_DIR": str(data)}
    return subprocess.run([str(context / "bin" / "render-config")], env={**base, **env},
                          capture_output=True, text=True, check=False)


def zoo_cfg(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "conf" / "zoo.cfg").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_zookeeper_alone_without_members(contexts: dict[str, Path], tmp_path: Path) -> None:
    result = render_zookeeper(contexts["zookeeper"], tmp_path)
    assert result.returncode == 0, result.stderr
    cfg = zoo_cfg(tmp_path)
    assert cfg["dataDir"] == str(tmp_path / "data") and cfg["clientPort"] == "2181"
    assert not any(key.startswith("server.") for key in cfg)
    assert cfg["4lw.commands.whitelist"] == "srvr"
    assert cfg["admin.enableServer"] == "false" and cfg["maxClientCnxns"] == "60"


def test_zookeeper_members_from_zoo_servers_with_myid(contexts: dict[str, Path], tmp_path: Path) -> None:
    servers = [f"server.{n}=zk-{n - 1}.zk-peers.ns.svc.cluster.local:2888:3888;2181" for n in (1, 2, 3)]
    refused = render_zookeeper(contexts["zookeeper"], tmp_path, ZOO_SERVERS=" ".join(servers))
    assert refused.returncode == 2 and "myid" in refused.stderr
    (tmp_path / "data" / "myid").write_text("2\n")
    result = render_zookeeper(contexts["zookeeper"], tmp_path, ZOO_SERVERS=" ".join(servers), ZOO_CLIENT_PORT="12181")
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "conf" / "zoo.cfg").read_text().splitlines()
    assert lines[-3:] == servers
    assert zoo_cfg(tmp_path)["clientPort"] == "12181"


@pytest.mark.parametrize("servers", ["server.1=zk;rm -rf /:2888:3888", "zk-0:2888:3888", "server.x=zk:1:2"])
def test_zookeeper_refuses_what_is_not_a_server_line(contexts: dict[str, Path], tmp_path: Path, servers: str) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "myid").write_text("1\n")
    result = render_zookeeper(contexts["zookeeper"], tmp_path, ZOO_SERVERS=servers)
    assert result.returncode == 2 and "ZOO_SERVERS" in result.stderr
    assert not (tmp_path / "conf" / "zoo.cfg").exists()


# --- Cassandra's configuration ---------------------------------------------------------------------


def render_cassandra(context: Path, tmp_path: Path, limit: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    limit_file = tmp_path / "memory.max"
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        4026532 kB\nMemFree:          100000 kB\n")
    if limit is not None:
        limit_file.write_text(limit + "\n")
    base = {"PATH": os.environ["PATH"], "HOSTNAME": "localhost", "CASSANDRA_HOME": str(context),
            "CASSANDRA_CONF_DIR": str(tmp_path / "conf"), "CASSANDRA_MEMORY_LIMIT_FILES": str(limit_file),
            "CASSANDRA_MEMINFO": str(meminfo)}
    return subprocess.run([str(context / "bin" / "render-config")], env={**base, **env},
                          capture_output=True, text=True, check=False)


def test_cassandra_yaml_from_the_environment(contexts: dict[str, Path], tmp_path: Path) -> None:
    result = render_cassandra(
        contexts["cassandra"], tmp_path, limit=str(2 << 30),
        CASSANDRA_CLUSTER_NAME="casque", CASSANDRA_SEEDS="casque-cassandra-0.peers,10.0.0.9",
        CASSANDRA_DC="dc1", CASSANDRA_RACK="rack2", CASSANDRA_ENDPOINT_SNITCH="GossipingPropertyFileSnitch",
        CASSANDRA_LISTEN_ADDRESS="10.244.0.7",
    )
    assert result.returncode == 0, result.stderr
    conf = tmp_path / "conf"
    config = yaml.safe_load((conf / "cassandra.yaml").read_text())
    assert config["cluster_name"] == "casque"
    assert config["listen_address"] == config["rpc_address"] == "10.244.0.7"
    assert config["seed_provider"][0]["parameters"][0]["seeds"] == "casque-cassandra-0.peers,10.0.0.9"
    assert config["endpoint_snitch"] == "GossipingPropertyFileSnitch"
    assert config["data_file_directories"] == ["/var/lib/cassandra/data"]
    assert config["commitlog_directory"] == "/var/lib/cassandra/commitlog"
    assert config["auto_bootstrap"] is True
    # Secure by default: logins and grants are checked unless the environment says otherwise.
    assert (config["authenticator"], config["authorizer"]) == ("PasswordAuthenticator", "CassandraAuthorizer")
    assert "@" not in (conf / "cassandra.yaml").read_text()
    assert (conf / "cassandra-rackdc.properties").read_text() == "dc=dc1\nrack=rack2\n"
    # Half of the 2 GiB limit.
    assert (conf / "heap").read_text() == "1024M\n"


def test_cassandra_without_logins_when_the_environment_asks(contexts: dict[str, Path], tmp_path: Path) -> None:
    result = render_cassandra(contexts["cassandra"], tmp_path, CASSANDRA_LISTEN_ADDRESS="10.0.0.1",
                              CASSANDRA_AUTHENTICATOR="AllowAllAuthenticator", CASSANDRA_AUTHORIZER="AllowAllAuthorizer")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((tmp_path / "conf" / "cassandra.yaml").read_text())
    assert (config["authenticator"], config["authorizer"]) == ("AllowAllAuthenticator", "AllowAllAuthorizer")


def test_cassandra_names_that_yaml_would_misread_are_refused(contexts: dict[str, Path], tmp_path: Path) -> None:
    for env in ({"CASSANDRA_CLUSTER_NAME": "x'\nauthenticator: none"}, {"CASSANDRA_SEEDS": "a, b"},
                {"MAX_HEAP_SIZE": "1g; rm"}, {"CASSANDRA_DC": "dc 1"},
                {"CASSANDRA_AUTHENTICATOR": "x\nauthorizer: AllowAllAuthorizer"}, {"CASSANDRA_AUTHORIZER": "a b"}):
        result = render_cassandra(contexts["cassandra"], tmp_path, CASSANDRA_LISTEN_ADDRESS="10.0.0.1", **env)
        assert result.returncode == 2, env
        assert next(iter(env)) in result.stderr


@pytest.mark.parametrize(
    ("limit", "heap"),
    [
        (str(2 << 30), "1024M"),  # the chart's 2Gi
        (str(64 << 30), "8192M"),  # at most 8G
        (str(700 << 20), "350M"),
        (str(300 << 20), "256M"),  # small limits still get what Cassandra starts with
        ("max", "1966M"),  # cgroup v2 without a limit: half of MemTotal (3932 MiB)
        ("9223372036854771712", "1966M"),  # cgroup v1's "no limit"
        (None, "1966M"),  # no cgroup file at all
    ],
)
def test_cassandra_heap_is_half_the_memory_limit(contexts: dict[str, Path], tmp_path: Path, limit: str | None, heap: str) -> None:
    result = render_cassandra(contexts["cassandra"], tmp_path, limit=limit, CASSANDRA_LISTEN_ADDRESS="10.0.0.1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "conf" / "heap").read_text() == f"{heap}\n"


def test_cassandra_defaults_and_max_heap_size(contexts: dict[str, Path], tmp_path: Path) -> None:
    # HOSTNAME=localhost resolves to 127.0.0.1 on any machine: the container's own address.
    result = render_cassandra(contexts["cassandra"], tmp_path, MAX_HEAP_SIZE="1536M")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((tmp_path / "conf" / "cassandra.yaml").read_text())
    assert config["listen_address"] == "127.0.0.1"
    assert config["seed_provider"][0]["parameters"][0]["seeds"] == "127.0.0.1"
    assert config["cluster_name"] == "casque"
    assert config["endpoint_snitch"] == "GossipingPropertyFileSnitch"
    assert (tmp_path / "conf" / "cassandra-rackdc.properties").read_text() == "dc=dc1\nrack=rack1\n"
    assert (tmp_path / "conf" / "heap").read_text() == "1536M\n"


def test_the_start_scripts_run_what_devstack_runs(contexts: dict[str, Path]) -> None:
    start = (contexts["cassandra"] / "bin" / "start").read_text()
    assert "org.apache.cassandra.service.CassandraDaemon" in start
    assert '"-Xmx${heap}"' in start and "-Dcassandra.logdir=/var/log/cassandra" in start
    assert "exec java" in start
    jamm = CASSANDRA.jar("jamm").name
    assert f"-javaagent:/opt/cassandra/lib/{jamm}" in start
    zk = (contexts["zookeeper"] / "bin" / "start").read_text()
    assert "org.apache.zookeeper.server.quorum.QuorumPeerMain" in zk and "exec java" in zk


def run_start_with_a_stand_in_java(start: Path, tmp_path: Path, env: dict[str, str]) -> list[str]:
    """The arguments `start` execs java with: a stand-in `java` first on the PATH writes them
    down, one per NUL-terminated record, and exits."""
    stand_in = tmp_path / "stand-in"
    stand_in.mkdir()
    argv_file = tmp_path / "argv"
    (stand_in / "java").write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" >{argv_file}\n")
    (stand_in / "java").chmod(0o755)
    result = subprocess.run([str(start)], env={**env, "PATH": f"{stand_in}:{os.environ['PATH']}"},
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return argv_file.read_bytes().decode().split("\0")[:-1]


def test_the_zookeeper_image_starts_the_jvm_as_the_local_server_does(contexts: dict[str, Path], tmp_path: Path) -> None:
    """bin/start's argv is ZooKeeperServer.java_command()'s with the image's paths in place of
    the local server's, plus what the container needs: its own flags, and nothing dropped."""
    from casque.devstack.zookeeper import ZooKeeperServer

    conf = tmp_path / "conf"
    (tmp_path / "data").mkdir()
    image = run_start_with_a_stand_in_java(contexts["zookeeper"] / "bin" / "start", tmp_path, {
        "ZOO_HOME": str(contexts["zookeeper"]), "ZOO_CONF_DIR": str(conf), "ZOO_DATA_DIR": str(tmp_path / "data"),
        "ZOO_HEAP_MB": "300",
    })
    # A member: the image runs QuorumPeerMain, alone or in an ensemble.
    local = ZooKeeperServer(tmp_path / "local", heap_mb=300, myid=1, peers=("server.1=127.0.0.1:2888:3888",))
    d = local.directory.resolve()
    paths = {
        f"-Dlogback.configurationFile={d}/logback.xml": "-Dlogback.configurationFile=/opt/zookeeper/conf/logback.xml",
        ZOOKEEPER.classpath(): "/opt/zookeeper/lib/*",
        f"{d}/zoo.cfg": f"{conf}/zoo.cfg",
    }
    command = local.java_command()
    assert command[:2] == ["java", f"-Dcasque.owner={d}"]
    expected = [paths.get(arg, arg) for arg in command[2:]]
    image_only = ["-XX:+ExitOnOutOfMemoryError", "-Djava.io.tmpdir=/tmp"]
    assert [arg for arg in image if arg not in image_only] == expected
    assert [arg for arg in image if arg in image_only] == image_only
    assert expected[-2:] == ["org.apache.zookeeper.server.quorum.QuorumPeerMain", f"{conf}/zoo.cfg"]
    assert "-Xmx300m" in image and (conf / "zoo.cfg").is_file()


def test_the_cassandra_image_starts_the_jvm_as_the_local_node_does(contexts: dict[str, Path], tmp_path: Path) -> None:
    """bin/start's argv is CassandraNode.java_command()'s with the image's paths and the heap
    from the environment, without the local ring's short ring delay, plus its scratch space."""
    from casque.devstack.cassandra import CassandraNode

    conf = tmp_path / "conf"
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        4026532 kB\n")
    image = run_start_with_a_stand_in_java(contexts["cassandra"] / "bin" / "start", tmp_path, {
        "HOSTNAME": "localhost", "CASSANDRA_HOME": str(contexts["cassandra"]), "CASSANDRA_CONF_DIR": str(conf),
        "CASSANDRA_MEMORY_LIMIT_FILES": str(tmp_path / "none"), "CASSANDRA_MEMINFO": str(meminfo),
        "MAX_HEAP_SIZE": "1000M",
    })
    local = CassandraNode(tmp_path / "local", heap_mb=1000, datacenter="dc1")
    d = local.directory.resolve()
    jamm = CASSANDRA.jar("jamm")
    paths = {
        "-Xms1000m": "-Xms1000M", "-Xmx1000m": "-Xmx1000M",
        f"-javaagent:{jamm}": f"-javaagent:/opt/cassandra/lib/{jamm.name}",
        f"-Dcassandra.config=file://{d}/cassandra.yaml": f"-Dcassandra.config=file://{conf}/cassandra.yaml",
        f"-Dcassandra-rackdc.properties=file://{d}/cassandra-rackdc.properties":
            f"-Dcassandra-rackdc.properties=file://{conf}/cassandra-rackdc.properties",
        f"-Dcassandra.storagedir={d}": "-Dcassandra.storagedir=/var/lib/cassandra",
        f"-Dcassandra.logdir={d}/logs": "-Dcassandra.logdir=/var/log/cassandra",
        f"-Dlogback.configurationFile={d}/logback.xml": "-Dlogback.configurationFile=/opt/cassandra/conf/logback.xml",
        CASSANDRA.classpath(): "/opt/cassandra/lib/*",
    }
    command = local.java_command()
    assert command[:2] == ["java", f"-Dcasque.owner={d}"]
    # A pod may join a ring in service, which Cassandra's own ring delay is for.
    expected = [paths.get(arg, arg) for arg in command[2:] if arg != "-Dcassandra.ring_delay_ms=1000"]
    assert [arg for arg in image if arg != "-Djava.io.tmpdir=/tmp"] == expected
    assert image.count("-Djava.io.tmpdir=/tmp") == 1
    assert expected[-1] == "org.apache.cassandra.service.CassandraDaemon"
    assert (conf / "cassandra.yaml").is_file()


@pytest.mark.parametrize(
    ("answer", "serving"),
    [
        (b"Zookeeper version: 3.9.4\nLatency min/avg/max: 0/0.0/0\nMode: leader\nNode count: 5\n", True),
        (b"Zookeeper version: 3.9.4\nMode: follower\n", True),
        (b"Zookeeper version: 3.9.4\nMode: standalone\n", True),
        # A member without a quorum.
        (b"This ZooKeeper instance is not currently serving requests\n", False),
        # srvr not in the whitelist.
        (b"srvr is not executed because it is not in the whitelist.\n", False),
        (b"Mode: observer\n", False),
    ],
)
def test_serving_is_true_only_for_a_serving_mode(contexts: dict[str, Path], answer: bytes, serving: bool) -> None:
    """bin/serving against a stand-in server on 127.0.0.1 that answers `srvr` as ZooKeeper does."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    asked: list[bytes] = []

    def answer_once() -> None:
        connection, _ = listener.accept()
        with connection:
            asked.append(connection.recv(16))
            connection.sendall(answer)

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    try:
        result = subprocess.run([str(contexts["zookeeper"] / "bin" / "serving")],
                                env={"PATH": os.environ["PATH"], "ZOO_CLIENT_PORT": str(port)},
                                capture_output=True, text=True, timeout=30, check=False)
        thread.join(10)
    finally:
        listener.close()
    assert asked == [b"srvr"]
    assert (result.returncode == 0) is serving, result.stderr


def test_serving_fails_when_nothing_listens(contexts: dict[str, Path]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    result = subprocess.run([str(contexts["zookeeper"] / "bin" / "serving")],
                            env={"PATH": os.environ["PATH"], "ZOO_CLIENT_PORT": str(port)},
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode != 0


# --- TLS from a Secret's PEM files ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pem_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tls.crt, tls.key and ca.crt, as a kubernetes.io/tls Secret with its CA mounts them."""
    pki = tmp_path_factory.mktemp("pki")
    ca_crt, ca_key = make_ca(pki)
    crt, key = issue_cert(pki, ca_crt, ca_key, "server", ["casque-cassandra.ns.svc.cluster.local"])
    mounted = pki / "mounted"
    mounted.mkdir()
    for source, name in ((crt, "tls.crt"), (key, "tls.key"), (ca_crt, "ca.crt")):
        (mounted / name).write_bytes(source.read_bytes())
    return mounted


def store_entries(store: Path, password: str) -> str:
    """What keytool lists in a PKCS12 store: the entry kinds Java sees."""
    result = subprocess.run(["keytool", "-list", "-keystore", str(store), "-storetype", "PKCS12",
                             "-storepass", password], capture_output=True, text=True, check=True)
    return result.stdout


def test_cassandra_speaks_tls_only_with_stores_made_from_the_pem_files(
    contexts: dict[str, Path], tmp_path: Path, pem_dir: Path,
) -> None:
    result = render_cassandra(contexts["cassandra"], tmp_path, CASSANDRA_LISTEN_ADDRESS="10.0.0.1",
                              CASSANDRA_TLS_DIR=str(pem_dir))
    assert result.returncode == 0, result.stderr
    assert "CQL over TLS only" in result.stderr
    conf = tmp_path / "conf"
    options = yaml.safe_load((conf / "cassandra.yaml").read_text())["client_encryption_options"]
    password = (conf / "store-password").read_text()
    assert options == {"enabled": True, "optional": False, "keystore": str(conf / "keystore.p12"),
                       "keystore_password": password, "truststore": str(conf / "truststore.p12"),
                       "truststore_password": password, "store_type": "PKCS12", "require_client_auth": False}
    assert len(password) >= 24
    # Java takes the key store's entry for a key with its certificate, the trust store's for a CA.
    assert "PrivateKeyEntry" in store_entries(conf / "keystore.p12", password)
    assert "trustedCertEntry" in store_entries(conf / "truststore.p12", password)
    for secret in ("keystore.p12", "truststore.p12", "store-password"):
        assert (conf / secret).stat().st_mode & 0o077 == 0, secret


def test_cassandra_without_tls_has_no_client_encryption(contexts: dict[str, Path], tmp_path: Path) -> None:
    result = render_cassandra(contexts["cassandra"], tmp_path, CASSANDRA_LISTEN_ADDRESS="10.0.0.1")
    assert result.returncode == 0, result.stderr
    assert "client_encryption_options" not in yaml.safe_load((tmp_path / "conf" / "cassandra.yaml").read_text())
    assert "CQL in plain text" in result.stderr


def test_a_tls_directory_without_its_files_is_refused(contexts: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cassandra = render_cassandra(contexts["cassandra"], tmp_path, CASSANDRA_LISTEN_ADDRESS="10.0.0.1",
                                 CASSANDRA_TLS_DIR=str(empty))
    assert cassandra.returncode == 2 and "has no readable tls.crt" in cassandra.stderr
    zookeeper = render_zookeeper(contexts["zookeeper"], tmp_path, ZOO_TLS_DIR=str(empty))
    assert zookeeper.returncode == 2 and "has no readable tls.crt" in zookeeper.stderr
    assert not (tmp_path / "conf" / "zoo.cfg").exists()


def test_zookeeper_serves_clients_over_tls_and_plain_text_on_its_loopback_only(
    contexts: dict[str, Path], tmp_path: Path, pem_dir: Path,
) -> None:
    servers = [f"server.{n}=zk-{n - 1}.zk-peers.ns.svc.cluster.local:2888:3888;2181" for n in (1, 2, 3)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "myid").write_text("1\n")
    result = render_zookeeper(contexts["zookeeper"], tmp_path, ZOO_SERVERS=" ".join(servers),
                              ZOO_TLS_DIR=str(pem_dir))
    assert result.returncode == 0, result.stderr
    conf = tmp_path / "conf"
    cfg = zoo_cfg(tmp_path)
    assert (cfg["secureClientPort"], cfg["clientPort"], cfg["clientPortAddress"]) == ("2281", "2181", "127.0.0.1")
    assert cfg["serverCnxnFactory"] == "org.apache.zookeeper.server.NettyServerCnxnFactory"
    assert cfg["ssl.keyStore.location"] == str(conf / "keystore.p12")
    assert cfg["ssl.trustStore.location"] == str(conf / "truststore.p12")
    assert cfg["ssl.keyStore.passwordPath"] == cfg["ssl.trustStore.passwordPath"] == str(conf / "store-password")
    assert cfg["ssl.clientAuth"] == "none"
    # A server line's client address wins over clientPortAddress: each names the loopback.
    assert [line for line in (conf / "zoo.cfg").read_text().splitlines() if line.startswith("server.")] == [
        line.replace(";2181", ";127.0.0.1:2181") for line in servers]
    password = (conf / "store-password").read_text()
    assert "PrivateKeyEntry" in store_entries(conf / "keystore.p12", password)


def test_cassandra_internode_traffic_over_tls_when_asked_with_the_same_stores(
    contexts: dict[str, Path], tmp_path: Path, pem_dir: Path,
) -> None:
    result = render_cassandra(contexts["cassandra"], tmp_path, CASSANDRA_LISTEN_ADDRESS="10.0.0.1",
                              CASSANDRA_TLS_DIR=str(pem_dir), CASSANDRA_INTERNODE_TLS="true")
    assert result.returncode == 0, result.stderr
    assert "internode traffic over TLS" in result.stderr
    conf = tmp_path / "conf"
    config = yaml.safe_load((conf / "cassandra.yaml").read_text())
    server, client = config["server_encryption_options"], config["client_encryption_options"]
    assert (server["internode_encryption"], server["legacy_ssl_storage_port_enabled"]) == ("all", False)
    # Each node proves itself to its peers with the CA's certificate; no peer's name is known.
    assert (server["require_client_auth"], server["require_endpoint_verification"]) == (True, False)
    for key in ("keystore", "keystore_password", "truststore", "truststore_password", "store_type"):
        assert server[key] == client[key], key


def test_cassandra_internode_traffic_stays_plain_unless_asked_and_needs_the_pem_files(
    contexts: dict[str, Path], tmp_path: Path, pem_dir: Path,
) -> None:
    plain = render_cassandra(contexts["cassandra"], tmp_path, CASSANDRA_LISTEN_ADDRESS="10.0.0.1",
                             CASSANDRA_TLS_DIR=str(pem_dir))
    assert "server_encryption_options" not in yaml.safe_load((tmp_path / "conf" / "cassandra.yaml").read_text())
    assert "internode traffic in plain text" in plain.stderr
    for env, error in (({"CASSANDRA_INTERNODE_TLS": "true"}, "CASSANDRA_INTERNODE_TLS=true needs CASSANDRA_TLS_DIR"),
                       ({"CASSANDRA_INTERNODE_TLS": "yes", "CASSANDRA_TLS_DIR": str(pem_dir)}, "true or false")):
        (tmp_path / "refused").mkdir(exist_ok=True)
        refused = render_cassandra(contexts["cassandra"], tmp_path / "refused", CASSANDRA_LISTEN_ADDRESS="10.0.0.1",
                                   **env)
        assert refused.returncode == 2 and error in refused.stderr, refused.stderr


def test_zookeeper_members_talk_over_tls_when_asked(contexts: dict[str, Path], tmp_path: Path, pem_dir: Path) -> None:
    servers = [f"server.{n}=zk-{n - 1}.zk-peers.ns.svc.cluster.local:2888:3888;2181" for n in (1, 2, 3)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "myid").write_text("1\n")
    result = render_zookeeper(contexts["zookeeper"], tmp_path, ZOO_SERVERS=" ".join(servers),
                              ZOO_TLS_DIR=str(pem_dir), ZOO_QUORUM_TLS="true")
    assert result.returncode == 0, result.stderr
    conf, cfg = tmp_path / "conf", zoo_cfg(tmp_path)
    assert cfg["sslQuorum"] == "true" and cfg["ssl.quorum.hostnameVerification"] == "false"
    assert cfg["ssl.quorum.keyStore.location"] == cfg["ssl.keyStore.location"] == str(conf / "keystore.p12")
    assert cfg["ssl.quorum.trustStore.location"] == cfg["ssl.trustStore.location"]
    assert cfg["ssl.quorum.keyStore.passwordPath"] == cfg["ssl.quorum.trustStore.passwordPath"] == str(
        conf / "store-password")
    (tmp_path / "plain" / "data").mkdir(parents=True)
    (tmp_path / "plain" / "data" / "myid").write_text("1\n")
    (tmp_path / "refused").mkdir()
    plain = render_zookeeper(contexts["zookeeper"], tmp_path / "plain", ZOO_SERVERS=" ".join(servers),
                             ZOO_TLS_DIR=str(pem_dir))
    assert plain.returncode == 0 and "sslQuorum" not in zoo_cfg(tmp_path / "plain")
    refused = render_zookeeper(contexts["zookeeper"], tmp_path / "refused", ZOO_QUORUM_TLS="true")
    assert refused.returncode == 2 and "ZOO_QUORUM_TLS=true needs ZOO_TLS_DIR" in refused.stderr


def test_renewed_pem_files_make_new_stores_under_the_password_the_server_holds(
    contexts: dict[str, Path], tmp_path: Path, pem_dir: Path,
) -> None:
    stores = contexts["zookeeper"] / "bin" / "stores"
    out = tmp_path / "conf"
    subprocess.run([str(stores), str(pem_dir), str(out)], check=True)
    password = (out / "store-password").read_text()
    first = (out / "keystore.p12").read_bytes()
    subprocess.run([str(stores), str(pem_dir), str(out), "again"], check=True)
    assert (out / "store-password").read_text() == password  # the running server's stays good
    assert (out / "keystore.p12").read_bytes() != first  # made anew (a new salt at least)
    assert "PrivateKeyEntry" in store_entries(out / "keystore.p12", password)
    assert not list(out.glob("*.new"))
    subprocess.run([str(stores), str(pem_dir), str(out)], check=True)
    assert (out / "store-password").read_text() != password  # a start makes its own


def test_zookeeper_reloads_the_stores_that_bin_start_renews(
    contexts: dict[str, Path], tmp_path: Path, pem_dir: Path,
) -> None:
    start = (contexts["zookeeper"] / "bin" / "start").read_text()
    assert 'refresh_stores &' in start and start.index("refresh_stores &") < start.index("exec java")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "myid").write_text("1\n")
    servers = "server.1=zk-0.peers:2888:3888;2181 server.2=zk-1.peers:2888:3888;2181"
    result = render_zookeeper(contexts["zookeeper"], tmp_path, ZOO_SERVERS=servers, ZOO_TLS_DIR=str(pem_dir),
                              ZOO_QUORUM_TLS="true")
    assert result.returncode == 0, result.stderr
    cfg = zoo_cfg(tmp_path)
    assert (cfg["client.certReload"], cfg["sslQuorumReloadCertFiles"]) == ("true", "true")
