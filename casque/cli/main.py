"""The `casque` command. Subcommands live in their own modules; errors become one line and an exit code."""

from __future__ import annotations

import sys

import typer

from casque.cli import apply, dev, queue_commands, resources, security, spark_commands, trace
from casque.cli.exits import guard_all, report
from casque.errors import CasqueError
from casque.operator import cli as operator_cli

app = typer.Typer(help="casque: a replayable queue on Cassandra and ZooKeeper.", no_args_is_help=True)
app.add_typer(dev.app, name="dev")
app.add_typer(operator_cli.app, name="operator")
app.add_typer(spark_commands.app, name="spark")
app.command("apply")(apply.apply_file)
app.command("delete")(apply.delete_file)
app.command("secure-znodes")(security.secure_znodes)
app.command("secure-cassandra")(security.secure_cassandra)
queue_commands.register(app)
resources.register(app)
trace.register(app)
# Every command maps casque's errors to one line and an exit code (casque/cli/exits.py).
guard_all(app)


def main() -> None:
    try:
        app(prog_name="casque")
    except CasqueError as error:  # raised outside a command, e.g. while typer builds it
        sys.exit(report(error))
