"""`casque dev ...`: run the local stack (a real Cassandra and ZooKeeper) on this machine."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from casque.cli.exits import ExitCode
from casque.cli.output import MACHINE, TableOutput, check, dumps
from casque.devstack import artifacts, backend_images
from casque.devstack.paths import state_dir
from casque.devstack.stack import MAX_DATACENTERS, MAX_NODES, Stack, StackPorts
from casque.errors import StackError

app = typer.Typer(help="Run a local Cassandra and ZooKeeper for development and tests.", no_args_is_help=True)
console = Console()

StateOption = Annotated[
    Path | None, typer.Option("--state-dir", help="Where data, logs and pid files live (default: $CASQUE_STATE_DIR or ~/.local/state/casque/dev).")
]


def _recorded(root: Path) -> Stack:
    stack = Stack.load(root)
    if stack is None:
        raise StackError(f"no stack was started from {root}; run `casque dev up`")
    return stack


@app.command()
def install() -> None:
    """Resolve the Cassandra and ZooKeeper jars into the cache (done by `up` too)."""
    artifacts.ensure_all()
    console.print(f"Cassandra {artifacts.CASSANDRA_VERSION}: {artifacts.CASSANDRA.lib_dir}")
    console.print(f"ZooKeeper {artifacts.ZOOKEEPER_VERSION}: {artifacts.ZOOKEEPER.lib_dir}")


@app.command("image-context")
def image_context(
    name: Annotated[str, typer.Argument(help="zookeeper or cassandra: the image of Dockerfile.<name>.")],
    directory: Annotated[Path, typer.Argument(help="Where the context goes (empty or absent).")],
) -> None:
    """Write the build context of a backend image: the server's jars, SHA256SUMS, its scripts.

    podman build -f Dockerfile.zookeeper DIR (or Dockerfile.cassandra) builds the image.
    """
    backend_images.write_context(name, directory)
    console.print(f"{name} image context in {directory}: podman build -f Dockerfile.{name} {directory}")


@app.command()
def up(
    nodes: Annotated[int | None, typer.Option(
        min=1, max=MAX_NODES, help="Cassandra nodes: 1, or a ring on 127.0.0.1-N (3 for a quorum in one datacenter).")] = None,
    datacenters: Annotated[int | None, typer.Option(
        min=1, max=MAX_DATACENTERS,
        help="Datacenters: 1, or 2 (dc1 and dc2, the nodes split between them, GossipingPropertyFileSnitch).")] = None,
    heap_mb: Annotated[int | None, typer.Option(min=512, help="Heap of each Cassandra node, in MiB.")] = None,
    cql_port: Annotated[int | None, typer.Option(help="CQL port (default 9042).")] = None,
    storage_port: Annotated[int | None, typer.Option(help="Cassandra inter-node port (default 7000).")] = None,
    jmx_port: Annotated[int | None, typer.Option(help="JMX port of node 1; node N uses +100*(N-1) (default 7199).")] = None,
    zookeeper_nodes: Annotated[int | None, typer.Option(
        min=1, max=5, help="ZooKeeper servers: 1, or an ensemble of 3 (or 5) on 127.0.0.1.")] = None,
    zookeeper_port: Annotated[int | None, typer.Option(
        help="ZooKeeper client port (default 2181); ensemble member N uses +N-1.")] = None,
    zookeeper_quorum_port: Annotated[int | None, typer.Option(
        help="Ensemble quorum port of member 1 (default 2888); member N uses +N-1.")] = None,
    zookeeper_election_port: Annotated[int | None, typer.Option(
        help="Ensemble election port of member 1 (default 3888); member N uses +N-1.")] = None,
    tls: Annotated[bool | None, typer.Option(
        "--tls/--no-tls", help="TLS: CQL over TLS only, ZooKeeper on a TLS port (client port + 100), "
        "with a CA and certificates made in <state-dir>/tls.")] = None,
    tls_client_auth: Annotated[bool | None, typer.Option(
        "--tls-client-auth/--no-tls-client-auth",
        help="With --tls: both servers require a client certificate of the stack's CA (mutual TLS).")] = None,
    auth: Annotated[bool | None, typer.Option(
        "--auth/--no-auth", help="Cassandra with PasswordAuthenticator; clients log in as superuser `casque` "
                             "with a random password (printed by `up`).")] = None,
    zookeeper_sasl: Annotated[bool | None, typer.Option(
        "--zookeeper-sasl/--no-zookeeper-sasl",
        help="ZooKeeper takes SASL DIGEST-MD5 logins of the installation user 'casque' (a JAAS file with "
        "a password made in the state directory); the settings printed log in with it.")] = None,
    locked: Annotated[bool, typer.Option(
        "--secure", help="Everything a default install of the chart locks: --tls, --auth and --zookeeper-sasl, "
        "and settings that give each namespace its own keyspace, role and ZooKeeper identity.")] = False,
    state: StateOption = None,
) -> None:
    """Start ZooKeeper and Cassandra (or find them running) and wait until both answer.

    With --datacenters 2 the nodes are split between datacenters dc1 and dc2 (`--nodes 2
    --datacenters 2`: one each), for keyspaces with NetworkTopologyStrategy.

    With --tls, --auth, --zookeeper-sasl or --secure it prints the CASQUE_* settings that reach
    the stack.

    With --zookeeper-nodes 3 ZooKeeper is an ensemble of three servers on 127.0.0.1, each
    with its own data directory, and the connect string printed lists all three.

    Settings not given are taken from the stack recorded in the state directory, if any.
    """
    root = state or state_dir()
    recorded = Stack.load(root)
    base = recorded.ports if recorded else StackPorts()
    ports = StackPorts(
        native=cql_port or base.native,
        storage=storage_port or base.storage,
        jmx=jmx_port or base.jmx,
        zookeeper=zookeeper_port or base.zookeeper,
        zookeeper_quorum=zookeeper_quorum_port or base.zookeeper_quorum,
        zookeeper_election=zookeeper_election_port or base.zookeeper_election,
    )
    ensemble = zookeeper_nodes or (recorded.zookeeper_nodes if recorded else 1)
    if ensemble % 2 == 0:
        # An even ensemble tolerates no more failures than the odd one below it, and a
        # two-member one tolerates none: refuse it rather than start something misleading.
        raise StackError(f"--zookeeper-nodes {ensemble}: an ensemble needs an odd number of servers (1, 3 or 5)")
    dc_count = datacenters or (recorded.datacenters if recorded else 1)
    node_count = nodes or (recorded.nodes if recorded else dc_count)
    heap = heap_mb or (recorded.heap_mb if recorded and recorded.nodes == node_count else (1536 if node_count == 1 else 1024))
    if locked:
        turned_off = [name for name, value in (("--no-tls", tls), ("--no-auth", auth),
                                               ("--no-zookeeper-sasl", zookeeper_sasl)) if value is False]
        if turned_off:
            raise StackError(f"--secure turns on what {', '.join(turned_off)} turns off: give one or the other")
        tls = auth = zookeeper_sasl = True
    isolation = locked or (recorded.isolation if recorded else False)
    if isolation and (tls is False or auth is False or zookeeper_sasl is False):
        raise StackError("this stack runs --secure: it cannot drop --tls, --auth or --zookeeper-sasl "
                         "(`casque dev down` and a new state directory start one without them)")
    secure = tls if tls is not None else (recorded.tls if recorded else False)
    client_auth = tls_client_auth if tls_client_auth is not None else (recorded.client_auth if recorded else False)
    password_auth = auth if auth is not None else (recorded.password_auth if recorded else False)
    sasl = zookeeper_sasl if zookeeper_sasl is not None else (recorded.zookeeper_sasl if recorded else False)
    if client_auth and not secure:
        raise StackError("--tls-client-auth needs --tls")
    if secure and ensemble != 1:
        raise StackError("--tls runs with a standalone ZooKeeper (--zookeeper-nodes 1)")
    stack = Stack(root=root, nodes=node_count, ports=ports, heap_mb=heap, zookeeper_nodes=ensemble,
                  datacenters=dc_count, tls=secure, client_auth=client_auth, password_auth=password_auth,
                  zookeeper_sasl=sasl, isolation=isolation)
    stack.up(report=lambda line: console.print(f"[dim]{line}[/dim]"))
    console.print("Cassandra: " + ", ".join(
        f"{node.address}:{node.native_port}" + (f" ({node.datacenter})" if node.datacenter else "")
        for node in stack.cassandra_nodes()) + (" (CQL over TLS)" if secure else " (CQL)"))
    console.print(f"ZooKeeper: {stack.zookeeper_hosts}" + (f", TLS on {stack.zookeeper_tls_hosts}" if secure else "")
                  + (" (SASL DIGEST-MD5 logins)" if sasl else ""))
    console.print(f"State and logs: {root}")
    if isolation:
        console.print("Namespaces: a keyspace, a Cassandra role and a ZooKeeper identity each, made by "
                      "`casque apply` (as the chart's operator does)")
    if secure or password_auth or sasl:
        console.print("Settings for clients of this stack:")
        for name, value in stack.client_env().items():
            typer.echo(f"export {name}={value}")


@app.command()
def status(state: StateOption = None, output: TableOutput = "table") -> None:
    """Show which services of the local stack run, where, and their logs (exit 4 if one is stopped)."""
    check(output, ("table", *MACHINE))
    stack = _recorded(state or state_dir())
    services = stack.status()
    if output in MACHINE:
        typer.echo(dumps([{"service": s.name, "address": s.address, "datacenter": s.datacenter, "running": s.running,
                           "pid": s.pid if s.running else None, "log": str(s.log)} for s in services], output))
        if not all(s.running for s in services):
            raise typer.Exit(ExitCode.BACKEND_UNAVAILABLE)
        return
    table = Table("service", "address", "datacenter", "pid", "log")
    for service in stack.status():
        table.add_row(service.name, service.address, service.datacenter or "",
                      str(service.pid) if service.running else "[red]stopped[/red]", str(service.log))
    console.print(table)
    if not all(s.running for s in stack.status()):
        # A stopped service is an unavailable backend (casque/cli/exits.py).
        raise typer.Exit(ExitCode.BACKEND_UNAVAILABLE)


@app.command()
def logs(
    service: Annotated[str, typer.Argument(
        help="zookeeper (zookeeper-1, -2, ... for an ensemble), cassandra-1, cassandra-2, ...")] = "cassandra-1",
    lines: Annotated[int, typer.Option("-n", "--lines")] = 50,
    follow: Annotated[bool, typer.Option("-f", "--follow")] = False,
    state: StateOption = None,
) -> None:
    """Print the end of a service's log."""
    stack = _recorded(state or state_dir())
    by_name = {s.name: s for s in stack.status()}
    if service not in by_name:
        raise StackError(f"unknown service {service!r}; one of: {', '.join(by_name)}")
    args = ["tail", "-n", str(lines)] + (["-F"] if follow else []) + [str(by_name[service].log)]
    subprocess.run(args, check=False)


@app.command()
def down(state: StateOption = None) -> None:
    """Stop exactly the processes `up` started."""
    root = state or state_dir()
    stack = Stack.load(root)
    if stack is None:
        console.print("nothing to stop")
        return
    stack.down(report=console.print)
    console.print("local stack stopped")
