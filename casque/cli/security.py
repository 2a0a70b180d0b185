"""`casque secure-znodes`: give every znode the ACL of casque's ZooKeeper policy (docs/security.md).

Run with the installation's credentials (CASQUE_ZOOKEEPER_USERNAME/_PASSWORD and
CASQUE_DERIVATION_KEY) after turning authentication on for an installation that ran open, or
after rotating the installation password (the operator re-secures a namespace's znodes itself
when a new derivation key changes its identity); it prints how many znodes changed, and a
second run prints 0 once nothing without credentials creates znodes any more.
"""

from __future__ import annotations

from typing import Annotated

import typer

from casque.config import Settings
from casque.engine import catalog
from casque.store import Store


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
