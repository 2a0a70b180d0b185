"""`casque sidecar`: serve the localhost HTTP API.

A module of its own, apart from the other commands: a sidecar runs in every pod, and
`casque.cli.main` loads only this one for it (their tables, progress bars and engine
imports cost it about 5 MiB of RSS).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from casque.cli.options import (
    CassandraOption,
    KeyspaceOption,
    LogFormatOption,
    ZookeeperOption,
    backend_settings,
    readable_errors,
)
from casque.sidecar.config import DEFAULT_PORT, SidecarSettings


def sidecar(
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="The queue whose subscribers to serve.")] = None,
    subscriber: Annotated[
        list[str] | None, typer.Option("--subscriber", "-s", help="A subscriber to consume for (repeatable).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on (default 127.0.0.1: the pod only).")] = None,
    port: Annotated[int | None, typer.Option(help=f"Port to listen on (default {DEFAULT_PORT}).")] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="The queues' namespace.")] = None,
    # No --token: a flag's value is visible to every user of the node in `ps`.
    token_file: Annotated[
        Path | None,
        typer.Option(help="Require the bearer token in this file (or set CASQUE_SIDECAR_TOKEN).", show_default=False),
    ] = None,
    drain_seconds: Annotated[float | None, typer.Option(help="On SIGTERM, time to let the app settle what it holds.")] = None,
    max_wait: Annotated[float | None, typer.Option(help="Longest long poll, in seconds.")] = None,
    push_url: Annotated[str | None, typer.Option(help="POST messages to this URL instead of waiting for receives.")] = None,
    push_concurrency: Annotated[int | None, typer.Option(help="Pushes under way at once.")] = None,
    log_format: LogFormatOption = "text",
    access_log: Annotated[
        bool | None, typer.Option("--access-log/--no-access-log", help="Log a line per request (off by default).",
                                  show_default=False),
    ] = None,
    cassandra: CassandraOption = None,
    zookeeper: ZookeeperOption = None,
    keyspace: KeyspaceOption = None,
) -> None:
    """Serve the localhost HTTP API (CASQUE_SIDECAR_* settings, overridden by these flags)."""
    from casque.sidecar.server import run

    given: dict[str, Any] = {
        "queue": queue, "subscribers": subscriber or None, "host": host, "port": port, "namespace": namespace,
        "token_file": token_file, "drain_seconds": drain_seconds, "max_wait_seconds": max_wait, "push_url": push_url,
        "push_concurrency": push_concurrency, "access_log": access_log,
    }
    with readable_errors():
        settings = SidecarSettings(**{k: v for k, v in given.items() if v is not None})
    run(settings, backend_settings(cassandra, zookeeper, keyspace), log_format)


def memory_growth(
    before: Annotated[Path, typer.Argument(help="A sidecar's earlier snapshot (SIGUSR2).", exists=True, dir_okay=False)],
    after: Annotated[Path, typer.Argument(help="A later snapshot of the same sidecar.", exists=True, dir_okay=False)],
    top: Annotated[int, typer.Option(min=1, help="Source lines to show.")] = 20,
) -> None:
    """The source lines whose live allocations grew most between two snapshots a sidecar
    wrote (CASQUE_SIDECAR_MEMORY_TRACE_FRAMES set, a SIGUSR2 for each). Snapshots are
    pickles: read only your own."""
    from casque.sidecar.memory_report import growth

    for grown in growth(before, after, top):
        typer.echo(grown.line())


def register(app: typer.Typer) -> None:
    app.command("sidecar")(sidecar)
    app.command("memory-growth")(memory_growth)
