"""Fixtures shared by all tests: the real backends (see tests/fixtures/), and the markers.

Every test under tests/integration/, and every test anywhere that asks for a server fixture,
is marked `integration` at collection, so `-m "not integration"` starts no server: the
session fixtures below start their servers only when a selected test asks for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from casque.devstack.stack import Stack

from tests.fixtures import scheduling
from tests.fixtures.consumers import consumers  # noqa: F401
from tests.fixtures.images import backend_images, images  # noqa: F401
from tests.fixtures.kube import kube_client, kube_cluster, kube_namespace  # noqa: F401
from tests.fixtures.node import (  # noqa: F401
    baseline_node_images,
    kube_node,
    node_address,
    node_cluster,
    node_images,
    node_pause_image,
    node_stack,
    second_node,
    stop_early,
)
from tests.fixtures.node_apps import node_keyspace_and_root  # noqa: F401
from tests.fixtures.node_release import embedded_release  # noqa: F401
from tests.fixtures.sidecars import start_sidecar  # noqa: F401
from tests.fixtures.spark_conf import use_short_lived_spark
from tests.fixtures.stack import (  # noqa: F401
    backends,
    cql,
    dc_ring,
    ensemble_zk_hosts,
    keyspace,
    keyspace_pool,
    new_store,
    ring,
    secure_stack,
    store,
    zk,
    zk_hosts,
    zookeeper_ensemble,
)

INTEGRATION = Path(__file__).parent / "integration"
# Fixtures that start a server (directly or through the fixtures they depend on).
SERVER_FIXTURES = frozenset({"backends", "ring", "dc_ring", "kube_cluster", "zookeeper_ensemble", "secure_stack",
                             "node_stack", "node_cluster", "kube_node", "embedded_release"})


def pytest_configure(config: pytest.Config) -> None:
    use_short_lived_spark()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if item.path.is_relative_to(INTEGRATION) or uses & SERVER_FIXTURES:
            item.add_marker(pytest.mark.integration)
        if uses & {"ring", "dc_ring"}:
            item.add_marker(pytest.mark.ring)


@pytest.hookimpl(optionalhook=True)  # the hook is xdist's: no error when it is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> scheduling.GroupScheduling | None:
    """Distributed runs keep modules, and the modules sharing a server, whole on one worker
    (tests/fixtures/scheduling.py); `--dist each` (every test on every worker) stays xdist's."""
    if config.getoption("dist") == "each":
        return None
    return scheduling.GroupScheduling(config, log)


# Stacks that a few modules use: stopped right after the last test that uses them rather than
# at the end of the session. Each is one to three idle Cassandra JVMs, and on two cores the
# tests after them ran beside them for the rest of the session. The last user in collection
# order is the last one a worker runs only if all users are one unit of the distributed run,
# which hands units out in an order of its own: each of these stacks is in a group of
# scheduling.GROUPS, and the check below holds every user to it.
# The node goes before its API server and the stack its pods use (the tuple's order is the
# order of stopping when one test is the last user of several).
STOPPED_AFTER_LAST_USE = ("ring", "dc_ring", "secure_stack", "kube_node", "node_cluster", "node_stack")
_last_user: dict[str, str] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note, once the order is final, which test is the last to use each of those stacks; in a
    distributed run, report the modules that use a group's server outside the group."""
    for item in session.items:
        for name in set(getattr(item, "fixturenames", ())) & set(STOPPED_AFTER_LAST_USE):
            _last_user[name] = item.nodeid
    # An xdist worker's options say dist "no"; it has `workerinput` instead.
    if hasattr(session.config, "workerinput") or session.config.getoption("dist", "no") != "no":
        fixtures_of: dict[str, set[str]] = {}
        for item in session.items:
            fixtures_of.setdefault(item.nodeid.split("::", 1)[0], set()).update(getattr(item, "fixturenames", ()))
        for module, group in scheduling.misplaced(fixtures_of).items():
            # As a failed collection: a worker passes it on to the controller, and the run fails.
            report = pytest.CollectReport(module, "failed", f"uses the server of group {group!r} outside the "
                                          "group: add it to GROUPS in tests/fixtures/scheduling.py", result=[])
            session.ihook.pytest_collectreport(report=report)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    finished = [name for name in STOPPED_AFTER_LAST_USE if _last_user.get(name) == item.nodeid]
    servers = [getattr(item, "funcargs", {}).get(name) for name in finished]
    yield  # the item's own teardown first: module fixtures built on a server go before it
    for server in servers:
        if isinstance(server, Stack):
            server.down()  # its session finalizer finds it down and releases its slot
        else:
            stop_early(server)  # the node and its API server (tests/fixtures/node.py)
