"""Fixtures shared by all tests: the real backends (see tests/fixtures/), and the markers.

Every test under tests/integration/, and every test anywhere that asks for a server fixture,
is marked `integration` at collection, so `-m "not integration"` starts no server: the
session fixtures below start their servers only when a selected test asks for them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.consumers import consumers  # noqa: F401
from tests.fixtures.images import images  # noqa: F401
from tests.fixtures.kube import kube_client, kube_cluster, kube_namespace  # noqa: F401
from tests.fixtures.node import kube_node, node_address, node_cluster, node_images, node_stack  # noqa: F401
from tests.fixtures.sidecars import start_sidecar  # noqa: F401
from tests.fixtures.stack import (  # noqa: F401
    backends,
    cql,
    dc_ring,
    ensemble_zk_hosts,
    keyspace,
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
                             "node_stack", "node_cluster", "kube_node"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if item.path.is_relative_to(INTEGRATION) or uses & SERVER_FIXTURES:
            item.add_marker(pytest.mark.integration)
        if uses & {"ring", "dc_ring"}:
            item.add_marker(pytest.mark.ring)
