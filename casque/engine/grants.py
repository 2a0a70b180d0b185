"""What the installation granted each queue: the most the engine acts on, whatever the spec says.

A namespace's identity may read its queues' spec znodes but not write them
(casque.backends.zkacl). Znodes made by a casque from before that policy keep the ACL that
let it write every znode below its namespace znode until the installation applies them
again, and an installation that ran without authentication lets anyone: so the spec a
sidecar reads may not be the one the operator applied within the namespace's quota (a tenant
rewrote its queue to 256 shards and 10 priority levels). So whenever the
installation applies a queue it also writes the queue's grant, `{root}/grants/<ns>/<queue>`:
the shards, priority levels and retention it approved. Grants live outside the namespace's
subtree, readable by the namespace and writable by the installation alone. (ZooKeeper
checks a create or delete against the parent's ACL, so a grant below the namespace znode
could be deleted and made again by the namespace itself.)

The engine reads the grant with the spec and refuses (`QuotaExceeded`) a spec with more
shards, priority levels or retention than granted, whoever wrote it; the operator's next
apply restores the spec (casque.engine.catalog.apply_queue). A queue without a grant (applied
by a casque from before grants) is not checked until its next apply writes one.

No state is held between calls: a read cut off by a lost or suspended connection raises
like any other read, and the caller's retry reads both znodes again.
"""

from __future__ import annotations

from kazoo.exceptions import NodeExistsError, NoNodeError
from pydantic import BaseModel, ConfigDict, ValidationError

from casque.errors import QuotaExceeded
from casque.schema import QueueRef
from casque.specs import QueueSpec, QueueState
from casque.store import Store


class QueueGrant(BaseModel):
    """The ceiling of a queue's spec: what the engine acts on at most."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shards: int
    priorities: int
    retention_seconds: int

    @classmethod
    def of(cls, spec: QueueSpec) -> QueueGrant:
        return cls(shards=spec.shards, priorities=spec.priorities, retention_seconds=spec.retention_seconds)

    def widest(self, other: QueueGrant) -> QueueGrant:
        """Both grants at once: while a spec changes, the old and the new one are allowed."""
        return QueueGrant(shards=max(self.shards, other.shards), priorities=max(self.priorities, other.priorities),
                          retention_seconds=max(self.retention_seconds, other.retention_seconds))


def excess(spec: QueueSpec, grant: QueueGrant) -> list[str]:
    """What `spec` has beyond `grant`; empty when the grant covers it."""
    found = []
    if spec.shards > grant.shards:
        found.append(f"{spec.shards} shards (granted {grant.shards})")
    if spec.priorities > grant.priorities:
        found.append(f"{spec.priorities} priority levels (granted {grant.priorities})")
    if spec.retention_seconds > grant.retention_seconds:
        found.append(f"retention {spec.retention_seconds}s (granted {grant.retention_seconds}s)")
    return found


def read(store: Store, queue: QueueRef) -> QueueGrant | None:
    """The queue's grant; None if it has none (or an unreadable one, which the next apply rewrites)."""
    try:
        data, _ = store.zk.get(store.paths(queue).grant)
    except NoNodeError:
        return None
    try:
        return QueueGrant.model_validate_json(data)
    except ValidationError:
        return None


def check(store: Store, queue: QueueRef, state: QueueState) -> QueueState:
    """`state` if its spec is within the queue's grant; QuotaExceeded if not."""
    grant = read(store, queue)
    beyond = excess(state.spec, grant) if grant is not None else []
    if beyond:
        raise QuotaExceeded(
            f"queue {queue}'s spec in ZooKeeper has {', '.join(beyond)}: it was changed outside the operator, "
            "and casque will not act on it until the operator applies the Queue again"
        )
    return state


def write(store: Store, queue: QueueRef, grant: QueueGrant) -> None:
    """Set the queue's grant (the installation's identity only: the namespace may not)."""
    path, data = store.paths(queue).grant, grant.model_dump_json().encode()
    try:
        store.zk.create(path, data, makepath=True)
    except NodeExistsError:
        store.zk.set(path, data)


def delete(store: Store, queue: QueueRef) -> None:
    try:
        store.zk.delete(store.paths(queue).grant)
    except NoNodeError:
        pass
