"""Fixtures shared by all tests: the real backends (see tests/fixtures/)."""

from tests.fixtures.sidecars import start_sidecar  # noqa: F401
from tests.fixtures.stack import (  # noqa: F401
    backends,
    cql,
    keyspace,
    new_store,
    ring,
    store,
    zk,
    zk_hosts,
)
