"""`casque backup` and `casque restore`: an installation's state into a directory, and back
into empty backends (casque.engine.backup; docs/operations.md says when and how)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from casque.cli.installation import installation
from casque.cli.options import CassandraOption, KeyspaceOption, ZookeeperOption
from casque.cli.output import MACHINE, TextOutput, check, dumps
from casque.engine import backup as backups

out = Console()

DirectoryArgument = Annotated[Path, typer.Argument(help="The backup's directory.")]


def _report(report: backups.Report, verb: str, directory: Path, output: str) -> None:
    if output in MACHINE:
        typer.echo(dumps({"rows": report.rows, "expiredCells": report.expired_cells,
                          "tables": [{"keyspace": t.keyspace, "table": t.table, "rows": t.rows}
                                     for t in report.tables]}, output))
        return
    for table in report.tables:
        out.print(f"{table.keyspace}.{table.table}: {table.rows} row(s)")
    out.print(f"{verb} {report.rows} row(s) of {len(report.tables)} table(s) {'into' if verb == 'backed up' else 'from'} "
              f"{directory}")


def backup(
    directory: DirectoryArgument,
    output: TextOutput = "text",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Write every queue, message within retention, ack, position, schema and filter into a new directory."""
    check(output, ("text", *MACHINE))
    with installation(cassandra, zookeeper, keyspace) as store:
        _report(backups.backup(store, directory), "backed up", directory, output)


def restore(
    directory: DirectoryArgument,
    output: TextOutput = "text",
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Write a backup into empty backends; applying the queues then rebuilds ZooKeeper from it."""
    check(output, ("text", *MACHINE))
    with installation(cassandra, zookeeper, keyspace) as store:
        report = backups.restore(store, directory)
    _report(report, "restored", directory, output)
    if output not in MACHINE:
        queues = ", ".join(str(ref) for ref, _ in backups.queues_in(directory)) or "none"
        out.print(f"queues: {queues}. Apply them (the operator does at its next refresh, or `casque apply -f`) "
                  "to rebuild their znodes from what was restored.")
        if report.expired_cells:
            out.print(f"{report.expired_cells} cell(s) expired since the backup and were left out")


def register(app: typer.Typer) -> None:
    app.command("backup")(backup)
    app.command("restore")(restore)
