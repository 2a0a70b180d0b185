"""What the commands share: the options naming the backends, the settings they make, and
validation failures as one line. Light on imports: `casque sidecar` loads it in every pod."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from casque.cli.exits import UsageError
from casque.config import Settings
from casque.logs import LOG_FORMAT_ENV, LogFormat

NamespaceOption = Annotated[str, typer.Option("--namespace", "-n", help="The queues' namespace.")]
CassandraOption = Annotated[
    str | None,
    typer.Option("--cassandra", help="Cassandra contact points HOST[,HOST...][:PORT] (default: CASQUE_* settings)."),
]
ZookeeperOption = Annotated[
    str | None, typer.Option("--zookeeper", help="ZooKeeper connect string (default: CASQUE_ZOOKEEPER_HOSTS).")
]
KeyspaceOption = Annotated[str | None, typer.Option("--keyspace", help="The installation's keyspace.")]
LogFormatOption = Annotated[
    LogFormat, typer.Option("--log-format", envvar=LOG_FORMAT_ENV, help="Log lines as text, or one JSON object each."),
]


def backend_settings(cassandra: str | None, zookeeper: str | None, keyspace: str | None) -> Settings:
    overrides: dict[str, Any] = {}
    if cassandra:
        hosts, _, port = cassandra.rpartition(":") if cassandra.rsplit(":", 1)[-1].isdigit() else (cassandra, "", "")
        overrides["cassandra_contact_points"] = hosts
        if port:
            overrides["cassandra_port"] = int(port)
    if zookeeper:
        overrides["zookeeper_hosts"] = zookeeper
    if keyspace:
        overrides["keyspace"] = keyspace
    with readable_errors():
        return Settings(**overrides)


@contextmanager
def readable_errors() -> Iterator[None]:
    """Settings and message validation failures as one line, like every other refusal."""
    try:
        yield
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in error.errors(include_url=False)
        )
        raise UsageError(problems) from None
