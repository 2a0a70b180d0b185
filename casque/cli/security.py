"""`casque secure-znodes`: give every znode the ACL of casque's ZooKeeper policy (docs/security.md).
`casque secure-cassandra`: replace Cassandra's default superuser by the installation's login.

Run with the installation's credentials (CASQUE_ZOOKEEPER_USERNAME/_PASSWORD and
CASQUE_DERIVATION_KEY) after turning authentication on for an installation that ran open, or
after rotating the installation password (the operator re-secures a namespace's znodes itself
when a new derivation key changes its identity); it prints how many znodes changed, and a
second run prints 0 once nothing without credentials creates znodes any more.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from casque.backends import superuser
from casque.config import Settings
from casque.engine import catalog
from casque.errors import AccessDenied, BackendUnavailable
from casque.store import Store

# Between attempts of `secure-cassandra --wait`: a node takes tens of seconds to start.
RETRY_SECONDS = 2.0


def secure_znodes(
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Only this namespace's znodes (default: the installation's).")
    ] = None,
) -> None:
    """Set the ACL casque's policy wants on every znode (of one namespace); prints how many changed."""
    store = Store.open(Settings())
    try:
        changed = catalog.secure_znodes(store, namespace)
    finally:
        store.close()
    where = f"namespace {namespace}" if namespace else "the installation"
    typer.echo(f"{changed} znode{'s' if changed != 1 else ''} of {where} given their ACL")


def secure_cassandra(
    wait: Annotated[
        float,
        typer.Option(help="Keep trying this many seconds while Cassandra, or enough of its nodes, is not up yet, "
                          "or does not take a login yet."),
    ] = 0.0,
) -> None:
    """Make CASQUE_CASSANDRA_USERNAME the cluster's superuser and disable the default cassandra/cassandra
    (docs/security.md). Idempotent: the chart's operator pods run it before they start."""
    deadline = time.monotonic() + wait
    while True:
        try:
            secured = superuser.secure_cassandra(Settings())
            break
        except (BackendUnavailable, AccessDenied) as error:
            # A node's default superuser is made just after it opens its CQL port, and a ring's
            # logins need a quorum of its system_auth replicas up: both come with time.
            if time.monotonic() >= deadline:
                raise
            typer.echo(f"waiting: {error}", err=True)
            time.sleep(RETRY_SECONDS)
    done = [what for what, happened in (("installation role created", secured.role_created),
                                        ("default superuser disabled", secured.default_disabled),
                                        ("system_auth replication set", secured.replication_changed)) if happened]
    typer.echo("Cassandra secured: " + (", ".join(done) if done else "nothing to change"))
