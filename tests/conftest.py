"""Fixtures shared by all tests: the real backends (see tests/fixtures/)."""

from tests.fixtures.stack import backends, cql, keyspace, new_store, ring, store, zk, zk_hosts  # noqa: F401
