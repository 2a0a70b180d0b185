"""The `casque` command. Subcommands live in their own modules; errors become one line and an exit code.

`casque sidecar` runs in every pod: for it only its own command is loaded (sidecar_command.py),
not the others' modules (tables, progress bars, the engine's tools, Spark's and the
operator's entry points). `app` is the whole command, made when first asked for.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from casque.cli.exits import guard_all, report
from casque.errors import CasqueError

HELP = "casque: a replayable queue on Cassandra and ZooKeeper."


def whole_app() -> typer.Typer:
    from casque.cli import (
        apply,
        backup_commands,
        dev,
        protocol_commands,
        queue_commands,
        resources,
        security,
        sidecar_command,
        spark_commands,
        trace,
    )
    from casque.operator import cli as operator_cli

    app = typer.Typer(help=HELP, no_args_is_help=True)
    app.add_typer(dev.app, name="dev")
    app.add_typer(operator_cli.app, name="operator")
    app.add_typer(spark_commands.app, name="spark")
    app.add_typer(protocol_commands.app, name="protocol")
    app.command("apply")(apply.apply_file)
    app.command("delete")(apply.delete_file)
    app.command("secure-znodes")(security.secure_znodes)
    app.command("secure-cassandra")(security.secure_cassandra)
    sidecar_command.register(app)
    queue_commands.register(app)
    resources.register(app)
    trace.register(app)
    backup_commands.register(app)
    # Every command maps casque's errors to one line and an exit code (casque/cli/exits.py).
    guard_all(app)
    return app


def sidecar_app() -> typer.Typer:
    """`casque` with `sidecar` alone, parsed as the whole command parses it."""
    from casque.cli import sidecar_command

    app = typer.Typer(help=HELP, no_args_is_help=True)
    # A callback keeps `sidecar` a subcommand: a Typer of one command would make it the root.
    app.callback()(lambda: None)
    sidecar_command.register(app)
    guard_all(app)
    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        globals()["app"] = made = whole_app()
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    app = sidecar_app() if sys.argv[1:2] == ["sidecar"] else whole_app()
    try:
        app(prog_name="casque")
    except CasqueError as error:  # raised outside a command, e.g. while typer builds it
        sys.exit(report(error))
