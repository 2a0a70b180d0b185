"""Quotas: limits per namespace on queues, shards x priorities, retention, znodes and their
bytes, and the bytes its keyspace stores and the rate it writes them
(casque.operator.storage_quota, casque.operator.write_quota).

Each shard of each priority level is a log of its own (a head, offsets, leases and a
partition range per subscriber), so shards x priorities is what a namespace's queues cost
the backends; retention is how much they keep; znodes and their bytes bound what its
sidecars may create in the ZooKeeper ensemble every namespace shares
(casque.engine.znode_quotas). The defaults come from the operator's settings
(CASQUE_QUOTA_*); a Namespace's annotations override them for that namespace, and only
cluster administrators may change a Namespace. `violations` is the
pure rule; the reconcile applies it to the queues that exist in the backends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from casque.engine.znode_quotas import ZnodeQuota
from casque.errors import InvalidSpec
from casque.specs import QueueSpec, format_duration, parse_duration

QUOTA_PREFIX = "quota.casque.io/"
MAX_QUEUES = f"{QUOTA_PREFIX}max-queues"
MAX_LOGS = f"{QUOTA_PREFIX}max-shard-priorities"
MAX_RETENTION = f"{QUOTA_PREFIX}max-retention"
MAX_ZNODES = f"{QUOTA_PREFIX}max-znodes"
MAX_ZNODE_BYTES = f"{QUOTA_PREFIX}max-znode-bytes"
MAX_STORED_BYTES = f"{QUOTA_PREFIX}max-stored-bytes"
MAX_WRITES_PER_SECOND = f"{QUOTA_PREFIX}max-writes-per-second"



class QuotaSettings(BaseSettings):
    """The installation's default limits per namespace, from CASQUE_QUOTA_*; unset: no limit."""

    model_config = SettingsConfigDict(env_prefix="CASQUE_QUOTA_")

    max_queues: int | None = Field(default=None, ge=0)
    max_shard_priorities: int | None = Field(default=None, ge=0)
    # Seconds, or 90s/15m/12h/7d as in a Queue's spec.
    max_retention: str | None = None
    # ZooKeeper's hard quota on the namespace's znodes (the namespace's own included).
    max_znodes: int | None = Field(default=None, ge=1)
    # ZooKeeper's hard quota on the bytes of data those znodes hold.
    max_znode_bytes: int | None = Field(default=None, ge=1)
    # Bytes on disk of the namespace's keyspace across the ring (keyspace isolation only):
    # past it, Cassandra refuses the namespace's publishes.
    max_stored_bytes: int | None = Field(default=None, ge=1)
    # Writes per second into the namespace's publishing tables (keyspace isolation only),
    # over the operator's measures (casque.operator.write_quota).
    max_writes_per_second: int | None = Field(default=None, ge=1)


@dataclass(frozen=True)
class Limits:
    max_queues: int | None = None
    max_shard_priorities: int | None = None
    max_retention_seconds: int | None = None
    max_znodes: int | None = None
    max_znode_bytes: int | None = None
    max_stored_bytes: int | None = None
    max_writes_per_second: int | None = None

    @property
    def any(self) -> bool:
        """Whether any limit on queues' specs is set (znodes are ZooKeeper's to count)."""
        return any(v is not None for v in (self.max_queues, self.max_shard_priorities, self.max_retention_seconds))

    @property
    def znodes(self) -> ZnodeQuota:
        """The namespace's hard quota in ZooKeeper."""
        return ZnodeQuota(max_znodes=self.max_znodes, max_bytes=self.max_znode_bytes)


def limits_for(defaults: QuotaSettings, annotations: Mapping[str, str] | None) -> Limits:
    """The namespace's limits: its annotations where it has them, the defaults elsewhere.
    An annotation that is empty lifts that limit for the namespace."""
    given = dict(annotations or {})

    def number(key: str, default: int | None) -> int | None:
        if key not in given:
            return default
        text = given[key].strip()
        if not text:
            return None
        if not text.isdigit():
            raise InvalidSpec(f"Namespace annotation {key}: {text!r} is not a whole number")
        return int(text)

    def positive(key: str, default: int | None) -> int | None:
        found = number(key, default)
        if found == 0:
            raise InvalidSpec(f"Namespace annotation {key}: 0 would leave the namespace no room at all (an "
                              "empty value lifts the limit)")
        return found

    def seconds(key: str, default: str | None) -> int | None:
        text = given.get(key, default)
        if text is None or not text.strip():
            return None
        try:
            return parse_duration(text.strip())
        except ValueError as error:
            raise InvalidSpec(f"quota {key}: {error}") from error

    return Limits(
        max_queues=number(MAX_QUEUES, defaults.max_queues),
        max_shard_priorities=number(MAX_LOGS, defaults.max_shard_priorities),
        max_retention_seconds=seconds(MAX_RETENTION, defaults.max_retention),
        max_znodes=positive(MAX_ZNODES, defaults.max_znodes),
        max_znode_bytes=positive(MAX_ZNODE_BYTES, defaults.max_znode_bytes),
        max_stored_bytes=positive(MAX_STORED_BYTES, defaults.max_stored_bytes),
        max_writes_per_second=positive(MAX_WRITES_PER_SECOND, defaults.max_writes_per_second),
    )


def violations(limits: Limits, others: Sequence[QueueSpec], current: QueueSpec | None, wanted: QueueSpec) -> list[str]:
    """Why `wanted` does not fit the namespace's limits, beside the namespace's other queues.

    Only growth is refused: a queue already over a limit that was lowered later keeps
    working and may change in any way that does not grow past the limit further, so that
    lowering a quota never breaks what runs.
    """
    problems = []
    if limits.max_queues is not None and current is None and len(others) + 1 > limits.max_queues:
        problems.append(f"the namespace may have {limits.max_queues} queues and has {len(others)} already")
    logs = wanted.shards * wanted.priorities
    grows = current is None or logs > current.shards * current.priorities
    if limits.max_shard_priorities is not None and grows:
        used = sum(other.shards * other.priorities for other in others)
        if used + logs > limits.max_shard_priorities:
            problems.append(
                f"shards x priorities would reach {used + logs} in the namespace ({used} in its other queues, "
                f"{wanted.shards} x {wanted.priorities} here); its limit is {limits.max_shard_priorities}"
            )
    longer = current is None or wanted.retention_seconds > current.retention_seconds
    if limits.max_retention_seconds is not None and longer and wanted.retention_seconds > limits.max_retention_seconds:
        problems.append(
            f"retention {format_duration(wanted.retention_seconds)} is longer than the namespace's limit of "
            f"{format_duration(limits.max_retention_seconds)}"
        )
    return problems
