"""`casque protocol`: the installation's protocol version, which record formats its sidecars
write (casque.engine.protocol; docs/operations.md "Versions" says when to raise it)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from casque.cli.installation import installation
from casque.cli.options import CassandraOption, KeyspaceOption, ZookeeperOption
from casque.cli.output import MACHINE, TextOutput, check, dumps
from casque.engine import protocol, protocol_change

app = typer.Typer(help="The installation's protocol version: which record formats sidecars write.",
                  no_args_is_help=True)
out = Console()


@app.command("show")
def show(
    output: TextOutput = "text",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """The version in force, the highest this release speaks, each group member's and each publisher's."""
    check(output, ("text", *MACHINE))
    with installation(cassandra, zookeeper, keyspace) as store:
        record = protocol.read(store)
        members = list(protocol_change.members(store))
        publishers = list(protocol_change.publishers(store))
    if output in MACHINE:
        typer.echo(dumps({
            "version": record.version, "speaks": protocol.PROTOCOL,
            "rollbackAfter": record.rollback_after.isoformat() if record.rollback_after else None,
            "members": [{"queue": m.queue, "subscriber": m.subscriber, "member": m.member, "protocol": m.protocol}
                        for m in members],
            "publishers": [{"queue": m.queue, "sidecar": m.member, "protocol": m.protocol} for m in publishers]},
            output))
        return
    out.print(f"protocol {record.version} (this release speaks {protocol.BASELINE}-{protocol.PROTOCOL})")
    if record.rollback_after is not None:
        out.print(f"records of a higher protocol may be read until {record.rollback_after.isoformat(timespec='seconds')}")
    older = [m for m in members if m.protocol < protocol.PROTOCOL]
    out.print(f"{len(members)} group member(s), {len(older)} speaking less than {protocol.PROTOCOL}")
    for member in older:
        out.print(f"  {member}")
    older = [m for m in publishers if m.protocol < protocol.PROTOCOL]
    out.print(f"{len(publishers)} sidecar(s) among queues' publishers, {len(older)} speaking less than "
              f"{protocol.PROTOCOL}")
    for publisher in older:
        out.print(f"  {publisher}")


@app.command("set")
def set_version(
    version: Annotated[int, typer.Argument(help="The protocol version to write in.")],
    force: Annotated[bool, typer.Option(help="Raise even while older members run (publishes may be stored twice).")] = False,
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Move the installation to VERSION: refused while a group member speaks less."""
    with installation(cassandra, zookeeper, keyspace) as store:
        change = protocol_change.set_version(store, version, force=force)
    out.print(change.describe())
