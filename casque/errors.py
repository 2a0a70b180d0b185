"""The error hierarchy of casque. Adapters map these to HTTP codes, CR conditions and exit codes."""

from __future__ import annotations


class CasqueError(Exception):
    """Base of every error casque raises on purpose."""

    code = "internal"


class StackError(CasqueError):
    """The local stack could not be installed, started or reached."""

    code = "stack_error"


class InvalidSpec(CasqueError):
    """A queue or subscriber definition breaks a rule (name, shards, retention, ...)."""

    code = "invalid_spec"


class BackendUnavailable(CasqueError):
    """Cassandra or ZooKeeper did not answer in time; the caller may retry."""

    code = "backend_unavailable"
