"""Creating, changing and removing queues and subscribers in Cassandra and ZooKeeper.

These are the reconcile actions of the operator and of `casque apply`: plain, idempotent
functions of (wanted spec, current state). Applying the same spec twice changes nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError, NotEmptyError, RolledBackError
from kazoo.security import ANYONE_ID_UNSAFE

from casque.engine import checkpoints, grants, positions, rebuild, schema_versions
from casque.engine.delayed import Cursor
from casque.errors import AccessDenied, BackendUnavailable, InvalidChange, InvalidSpec, QueueNotFound, SubscriberNotFound
from casque.schema import (
    QueueRef,
    count_queue_tables,
    drop_messages_table_ddl,
    drop_role_cql,
    ensure_keyspace,
    ensure_queue_table,
    namespace_role_cql,
    namespace_writes_cql,
    read_table_options,
    validate_name,
)
from casque.specs import QueueSpec, QueueState, SubscriberSpec, SubscriberState
from casque.store import Store
from casque.tenancy import NamespaceRole
from casque.znodes import SubscriberPaths, decode_head, decode_offset, queues_root

# Cassandra's memory use grows with the number of tables; warn well before it hurts.
TABLE_COUNT_WARNING = 200
# Deleting a subscriber races with its members joining; this many tries before giving up.
DELETE_ATTEMPTS = 20
# After a lowered retention, expiry is taken as out of order this much longer than the
# old retention: rows written around the change, clocks a little apart.
EXPIRY_SLACK_SECONDS = 300


@dataclass
class Changes:
    """What an apply did, for status messages and events."""

    actions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # What ZooKeeper had lost and was rebuilt from Cassandra (casque.engine.rebuild).
    rebuilt: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.actions or self.rebuilt)


def ensure_installation(store: Store) -> None:
    """The keyspace, the shared tables and the root znodes."""
    ensure_keyspace(store.session, store.keyspace, store.replication_cql)
    store.zk.ensure_path(f"{store.zk_root}/queues")


def ensure_namespace_keyspace(store: Store, namespace: str) -> None:
    """With keyspace isolation, the namespace's keyspace and its shared tables, replicated
    like the installation's. Without, nothing: the namespace uses the installation's."""
    if store.isolation:
        ensure_keyspace(store.session, store.keyspace_of(namespace), store.replication_cql)


def ensure_namespace_role(store: Store, role: NamespaceRole, publishing: bool = True) -> None:
    """The namespace's login role, with its current password, allowed to read and write
    its keyspace and nothing else (its keyspace must exist: `ensure_namespace_keyspace`);
    without `publishing`, to write only what consuming needs (`set_namespace_publishing`).

    The password is set on every call: it is derived from the installation's derivation key,
    which may have been rotated since the role was made; from then on Cassandra refuses the
    old password. Connections already open stay authenticated.
    """
    for statement, values in namespace_role_cql(role.username, role.password, role.keyspace, publishing):
        store.session.execute(statement, values)


def set_namespace_publishing(store: Store, role: NamespaceRole, publishing: bool) -> None:
    """Let the namespace's role write every table of its keyspace, or only the tables its
    consumers write (a stored-bytes quota reached): its sidecars' publishes, and any write
    of its own to its queues' tables, are then refused by Cassandra. Takes effect as
    Cassandra's permissions cache renews (permissions_validity)."""
    for statement in namespace_writes_cql(role.username, role.keyspace, publishing):
        store.session.execute(statement)


def drop_namespace_role(store: Store, role: NamespaceRole) -> None:
    """The namespace's last Queue is gone: nobody may log in as it. Its keyspace stays
    (retained queues keep their tables), reachable again by the same role once a Queue
    recreates it."""
    store.session.execute(drop_role_cql(role.username))


def secure_znodes(store: Store, namespace: str | None = None) -> int:
    """Give every znode of the installation (or of one namespace) the ACL casque's policy
    wants, and return how many changed.

    For an installation that ran without ZooKeeper authentication (its znodes open to
    anyone) and for a rotation of the installation password or of the derivation key (ACLs
    naming the old identities only): run it with the new settings, once the sidecars hold
    credentials the new ACLs name. A znode created while the walk runs already gets the new
    ACL from its creator, or, from a sidecar still without credentials, an open one that the
    next run fixes.
    """
    if getattr(store.zk, "acl_policy", None) is None:
        raise InvalidSpec("no ZooKeeper credentials are configured (CASQUE_ZOOKEEPER_USERNAME/_PASSWORD)")
    if namespace:
        name = validate_name("namespace", namespace)
        # Its grants too: outside its subtree, but their ACL names the namespace's identity.
        return (secure_tree(store, f"{queues_root(store.zk_root)}/{name}")
                + secure_tree(store, f"{store.zk_root.rstrip('/')}/grants/{name}"))
    return secure_tree(store, store.zk_root)


def secure_tree(store: Store, top: str) -> int:
    """Give `top` and every znode below it the ACL of the policy where it differs; how many changed.

    A znode the installation may not touch (its ACL names someone else alone, which ZooKeeper
    lets a creator set, on a server without the installation as its superuser) is passed
    over with what is below it, and the walk goes on: every other znode gets its ACL, and
    AccessDenied then names those left."""
    policy = store.zk.acl_policy
    pending = [top]
    changed = 0
    refused: list[str] = []
    while pending:
        path = pending.pop()
        try:
            current, stat = store.zk.get_acls(path)
            wanted = policy.acl_for(path)
            if set(current) != set(wanted):
                # The ACL version checks that nobody changed it since we read it.
                store.zk.set_acls(path, wanted, version=stat.aversion)
                changed += 1
            pending.extend(f"{path.rstrip('/')}/{child}" for child in store.zk.get_children(path))
        except NoNodeError:
            continue  # an ephemeral znode gone meanwhile
        except NoAuthError:
            refused.append(path)
    if refused:
        shown = ", ".join(sorted(refused)[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        raise AccessDenied(f"{changed} znode(s) given their ACL; ZooKeeper refused the installation on "
                           f"{len(refused)} (with what is below them): {shown}; give its login ZooKeeper's "
                           "superuser (docs/security.md)")
    return changed


def read_int(store: Store, path: str) -> int:
    """A head znode's batch."""
    data, _ = store.zk.get(path)
    return decode_head(data)


def read_offset(store: Store, paths: SubscriberPaths, shard: int) -> int:
    """The batch a subscriber reads next in `shard` (its epoch aside)."""
    data, _ = store.zk.get(paths.offset(shard))
    return decode_offset(data)[0]


def read_queue(store: Store, queue: QueueRef, granted: bool = True) -> QueueState:
    """The queue's state. Checked against the queue's grant (casque.engine.grants) unless
    `granted` is false, which only the installation's own repairs and reports ask for."""
    try:
        data, _ = store.zk.get(store.paths(queue).base)
    except NoNodeError as missing:
        raise QueueNotFound(f"queue {queue} does not exist") from missing
    if not data:  # created by a path of a child, or an apply that stopped half-way
        raise QueueNotFound(f"queue {queue} does not exist")
    state = QueueState.model_validate_json(data)
    return grants.check(store, queue, state) if granted else state


def apply_queue(store: Store, queue: QueueRef, spec: QueueSpec) -> Changes:
    # Shared tables first: an installation upgraded to a version with new shared tables
    # gets them with the first apply (every statement is IF NOT EXISTS).
    ensure_installation(store)
    ensure_namespace_keyspace(store, queue.namespace)
    keyspace = store.keyspace_of(queue.namespace)
    changes = Changes()
    paths = store.paths(queue)
    try:
        current: QueueState | None = read_queue(store, queue, granted=False)
    except QueueNotFound:
        current = None
    if current is None:
        current = _rebuilt(store, queue, keyspace, changes)
    # Before anything is written: a refused schema leaves the queue as it was.
    version = (schema_versions.first_version(queue, spec) if current is None
               else schema_versions.next_version(queue, current, spec))
    if current is not None and version == current.schema_version and (
            old := schema_versions.kept_from_before(spec)) is not None:
        changes.warnings.append(f"schema version {version} stays in force, though a new schema like it would be "
                                f"refused ({old}); change it (docs/schemas.md)")
    grant = grants.read(store, queue) if current is not None else None
    # A spec beyond its grant was written by someone else than the installation (a namespace,
    # through the ACL an older casque gave its spec znode): the grant, not that spec, is what
    # the queue really has, so going back to it is a repair, not a removal of shards.
    tampered = current is not None and grant is not None and bool(grants.excess(current.spec, grant))
    had = grants.QueueGrant.of(current.spec) if current is not None and not tampered else grant
    if had is not None and spec.shards < had.shards:
        raise InvalidChange(
            f"queue {queue} has {had.shards} shards; shards can be added, never removed"
        )
    if had is not None and spec.priorities < had.priorities:
        raise InvalidChange(
            f"queue {queue} has {had.priorities} priority levels; levels can be added, never removed"
        )
    wanted = grants.QueueGrant.of(spec)
    # While the spec changes, engines reading it must accept the old and the new one: the
    # grant widens before the spec is written and narrows to the new spec after. (Written
    # only when it differs: most applies change nothing.)
    widened = wanted if had is None else wanted.widest(had)
    if widened != grant:
        grants.write(store, queue, widened)
    mixed_until = current.expiry_mixed_until if current is not None else None
    written_ttl = read_table_options(store.session, keyspace, queue).default_time_to_live if current else 0
    if 0 < spec.retention_seconds < written_ttl:
        # Rows written until now keep their longer TTL: expiry is out of order until they go.
        lowered = datetime.now(timezone.utc) + timedelta(seconds=written_ttl + EXPIRY_SLACK_SECONDS)
        mixed_until = max(mixed_until, lowered) if mixed_until is not None else lowered
    if current is not None and current.expiry_mixed_until != mixed_until:
        # Written before the table changes: a crash between the two cannot lose it.
        current = current.model_copy(update={"expiry_mixed_until": mixed_until})
        store.zk.set(paths.base, current.model_dump_json().encode())
    if ensure_queue_table(store.session, keyspace, queue, spec.retention_seconds):
        changes.actions.append(
            f"table {queue.messages_table} {'created' if current is None else 'retention set'}"
            f" ({spec.retention_seconds}s)"
        )
    if current is None:
        _create_queue_znodes(store, queue, spec, version)
        changes.actions.append("queue znode created")
    elif current.spec != spec or current.schema_version != version:
        updated = current.model_copy(update={"spec": spec, "schema_version": version})
        store.zk.set(paths.base, updated.model_dump_json().encode())
        changes.actions.append("queue spec restored (it was changed outside the operator)" if tampered
                               else "queue spec updated")
        if version != current.schema_version:
            changes.actions.append(f"schema version {version}")
    if widened != wanted:
        grants.write(store, queue, wanted)
    # The state as applied, for a ZooKeeper that loses it (casque.engine.rebuild).
    applied = read_queue(store, queue, granted=False)
    checkpoints.record_queue(store, queue, applied)
    for shard in spec.log_shards():
        if _create_if_absent(store, paths.head(shard), b"0") and current is not None:
            changes.actions.append(f"shard {shard} added")
        _create_if_absent(store, paths.totals(shard), b"")
    changes.rebuilt.extend(rebuild.raise_heads(store, queue, applied))
    # Made by the installation since a release after the queue's: a queue made before gets them now.
    _create_if_absent(store, paths.redrive, b"")
    _create_if_absent(store, paths.publishers, b"")
    # Subscribers read new shards from their first batch.
    subscribers = list_subscribers(store, queue)
    for name in subscribers:
        for shard in spec.log_shards():
            _create_if_absent(store, paths.subscriber(name).offset(shard), b"1")
    if current is not None and _acl_outdated(store, paths.base):
        # Znodes made by a casque whose namespaces could write every znode of their queues:
        # the containers its sidecars used to create themselves first, then the ACLs.
        for name in subscribers:
            _ensure_subscriber_containers(store, paths.subscriber(name))
        changes.actions.append(f"{secure_tree(store, paths.base)} znodes given their ACL")
    tables = count_queue_tables(store.session, keyspace)
    if tables >= TABLE_COUNT_WARNING:
        changes.warnings.append(
            f"keyspace {keyspace} holds {tables} queue tables; Cassandra slows down past a few hundred"
        )
    return changes


def _rebuilt(store: Store, queue: QueueRef, keyspace: str, changes: Changes) -> QueueState | None:
    """The queue as Cassandra recorded it, its znodes made again, when ZooKeeper lost them
    while its table was kept; None for a queue to create (casque.engine.rebuild)."""
    recorded = checkpoints.recorded_queue(store, queue)
    if recorded is None or not read_table_options(store.session, keyspace, queue).exists:
        return None
    changes.rebuilt.extend(rebuild.rebuild_queue(store, queue, recorded))
    return recorded


def _create_queue_znodes(store: Store, queue: QueueRef, spec: QueueSpec, schema_version: int) -> None:
    """A new incarnation of the queue: its znodes first, its data (what makes it exist) last.

    Readers take a queue znode without data for no queue, so nobody sees a queue without
    its heads. Such a znode found here is what a deletion left (or election znodes that a
    mover of the deleted queue made): it is removed first, so that the new incarnation
    inherits no heads, subscribers or cursor from the old one.
    """
    paths = store.paths(queue)
    _delete_tree(store, paths.base, f"queue {queue}")
    # Records of an earlier incarnation (its table was dropped) must not come back with this one.
    checkpoints.forget_queue(store, queue)
    state = QueueState(spec=spec, created_at=datetime.now(timezone.utc), incarnation=uuid.uuid4().hex[:12],
                       schema_version=schema_version)
    store.zk.create(paths.base, b"", makepath=True)
    store.zk.create(paths.subscribers, b"")
    # The delayed-message mover starts from the queue's creation (see casque.engine.delayed).
    store.zk.create(paths.mover, Cursor(state.created_at, state.created_at).encode())
    # Made here, where the queue's children are made: a namespace's identity may write the
    # marks but create nothing below its queue's spec znode (casque.backends.zkacl).
    store.zk.create(paths.redrive, b"")
    store.zk.create(paths.publishers, b"")
    for shard in spec.log_shards():
        store.zk.create(paths.head(shard), b"0", makepath=True)
        store.zk.create(paths.totals(shard), b"")
    store.zk.set(paths.base, state.model_dump_json().encode())


def delete_queue(store: Store, queue: QueueRef, policy: str) -> Changes:
    """Delete drops the table and the znodes; Retain keeps both, so re-creating the queue finds its data.

    The queue's data is emptied first: from then on the queue does not exist for anyone,
    and an apply that comes before the rest is gone creates a new incarnation.
    """
    changes = Changes()
    if policy != "Delete":
        changes.actions.append("retained table and znodes")
        return changes
    base = store.paths(queue).base
    # Forgotten first: a ZooKeeper lost from here on must not bring the queue back.
    checkpoints.forget_queue(store, queue)
    try:
        store.zk.set(base, b"")
    except NoNodeError:
        pass
    store.session.execute(drop_messages_table_ddl(store.keyspace_of(queue.namespace), queue))
    _delete_tree(store, base, f"queue {queue}")
    grants.delete(store, queue)
    changes.actions.append(f"dropped table {queue.messages_table} and removed znodes")
    return changes


def _delete_tree(store: Store, path: str, what: str) -> None:
    """Delete `path` and everything under it, whoever keeps adding children.

    Live members keep creating ephemeral znodes (registrations, leases, elections), so a
    recursive delete, which is not atomic, can meet a child created after it listed them:
    it is repeated until it finds no newcomer.
    """
    for _ in range(DELETE_ATTEMPTS):
        try:
            store.zk.delete(path, recursive=True)
        except NotEmptyError:
            continue
        except NoNodeError:
            pass
        return
    raise BackendUnavailable(f"{what}: members kept adding znodes while it was deleted; try again")


def list_queues(store: Store, namespace: str | None = None) -> list[QueueRef]:
    root = f"{store.zk_root}/queues"
    namespaces = [namespace] if namespace else _children(store, root)
    return sorted(QueueRef(ns, name) for ns in namespaces for name in _children(store, f"{root}/{ns}"))


def list_subscribers(store: Store, queue: QueueRef) -> list[str]:
    return sorted(_children(store, store.paths(queue).subscribers))


def read_subscriber(store: Store, queue: QueueRef, name: str) -> SubscriberState:
    try:
        data, _ = store.zk.get(store.paths(queue).subscriber(name).base)
    except NoNodeError as missing:
        raise SubscriberNotFound(f"subscriber {name} of queue {queue} does not exist") from missing
    if not data:
        # Only a subscriber half-deleted (a recursive delete removes children first) reads so.
        raise SubscriberNotFound(f"subscriber {name} of queue {queue} is being deleted")
    return SubscriberState.model_validate_json(data)


def apply_subscriber(store: Store, queue: QueueRef, name: str, spec: SubscriberSpec) -> Changes:
    """Create the subscriber (offsets set from its start position) or update its settings.

    The start position applies once, at creation; moving an existing subscriber is a seek.
    """
    validate_name("subscriber", name)
    if spec.queue != queue.name:
        raise InvalidChange(f"subscriber {name} names queue {spec.queue}, not {queue.name}")
    queue_state = read_queue(store, queue)
    changes = Changes()
    paths = store.paths(queue).subscriber(name)
    try:
        current: SubscriberState | None = read_subscriber(store, queue, name)
    except SubscriberNotFound:
        current = None
    if current is None:
        current = _rebuilt_subscriber(store, queue, queue_state, name, changes)
    if current is None:
        offsets = {
            shard: start_offset(store, queue, shard, read_int(store, store.paths(queue).head(shard)), spec,
                                queue_state.expiry_in_order(datetime.now(timezone.utc)))
            for shard in queue_state.spec.log_shards()
        }
        state = SubscriberState(spec=spec, created_at=datetime.now(timezone.utc), incarnation=uuid.uuid4().hex[:12])
        # Recorded first, with its start: a ZooKeeper lost right after still has it to rebuild.
        checkpoints.record_subscriber(store, queue, name, state)
        positions_of = checkpoints.Checkpoints(store, queue, queue_state.shared_key(queue))
        for shard, offset in offsets.items():
            positions_of.write_sync(state.ack_key(name), shard, checkpoints.Position(offset))
        # One transaction: nobody ever sees a subscriber znode without its settings or its
        # offsets (a sidecar reading it midway would fail to parse it or find no offset).
        store.zk.ensure_path(store.paths(queue).subscribers)
        transaction = store.zk.transaction()
        transaction.create(paths.base, _subscriber_json(state))
        # Every container of the subscriber, and its seek record: the namespace's sidecars
        # create in these and write that, but may create nothing below the subscriber's spec
        # znode (casque.backends.zkacl).
        for directory in (*_subscriber_containers(paths), paths.seek):
            transaction.create(directory, b"")
        for shard, offset in offsets.items():
            transaction.create(paths.offset(shard), str(offset).encode())
        failures = [r for r in transaction.commit() if isinstance(r, Exception)]
        if failures:
            cause = next(f for f in failures if not isinstance(f, RolledBackError))
            if isinstance(cause, NodeExistsError):
                return apply_subscriber(store, queue, name, spec)  # created meanwhile by someone else
            raise cause
        changes.actions.append(f"subscriber created at {_describe(spec.start_position)}")
    else:
        if current.spec != spec:
            current = current.model_copy(update={"spec": spec})
            store.zk.set(paths.base, _subscriber_json(current))
            changes.actions.append("subscriber spec updated")
        checkpoints.record_subscriber(store, queue, name, current)
        changes.rebuilt.extend(rebuild.raise_epoch(store, queue, queue_state, name, current))
        changes.rebuilt.extend(rebuild.raise_shared_offsets(store, queue, queue_state, name, current))
        # Also in an installation still open, for `casque secure-znodes` to find them there.
        _ensure_subscriber_containers(store, paths)
        if _acl_outdated(store, paths.base):
            changes.actions.append(f"{secure_tree(store, paths.base)} znodes given their ACL")
    return changes


def _rebuilt_subscriber(store: Store, queue: QueueRef, queue_state: QueueState, name: str,
                        changes: Changes) -> SubscriberState | None:
    """The subscriber as Cassandra recorded it, its znodes made again with its offsets, when
    ZooKeeper lost them; None for a subscriber to create."""
    recorded = checkpoints.recorded_subscribers(store, queue).get(name)
    if recorded is None:
        return None
    offsets = checkpoints.Checkpoints(store, queue, queue_state.shared_key(queue)).read(recorded.ack_key(name))
    changes.rebuilt.extend(rebuild.rebuild_subscriber(store, queue, queue_state, name, recorded, offsets))
    return recorded


def _subscriber_containers(paths: SubscriberPaths) -> tuple[str, ...]:
    return (paths.offsets, paths.members, paths.leases, paths.fences, paths.cursors, paths.claims_root)


def _ensure_subscriber_containers(store: Store, paths: SubscriberPaths) -> None:
    """The containers and seek record a subscriber made by an older casque may lack (its
    sidecars created them then). Never with makepath: that would bring back a subscriber
    deleted meanwhile, empty."""
    try:
        present = set(store.zk.get_children(paths.base))
    except NoNodeError:
        return
    for path in (*_subscriber_containers(paths), paths.seek):
        if path.rsplit("/", 1)[1] in present:
            continue
        try:
            store.zk.create(path, b"")
        except (NodeExistsError, NoNodeError):
            pass  # made by a sidecar meanwhile, or the subscriber is gone


def _acl_outdated(store: Store, path: str) -> bool:
    """Whether `path`'s ACL differs from the policy's, while the installation's znodes are
    secured: open znodes (an installation that ran without authentication) wait for
    `casque secure-znodes`, once sidecars hold credentials (docs/security.md)."""
    policy = getattr(store.zk, "acl_policy", None)
    if policy is None:
        return False
    try:
        acl, _ = store.zk.get_acls(path)
    except NoNodeError:
        return False
    if any(entry.id == ANYONE_ID_UNSAFE for entry in acl):
        return False
    return set(acl) != set(policy.acl_for(path))


def delete_subscriber(store: Store, queue: QueueRef, name: str) -> Changes:
    """A subscriber's state lives in ZooKeeper, its record in the catalog and its positions in
    rows keyed by its incarnation (never read again once it is gone), so deleting it is always safe.

    Emptying the subscriber's data first tells every member it is going (they stop) before
    its znodes go.
    """
    path = store.paths(queue).subscriber(name).base
    # Forgotten first: a ZooKeeper lost from here on must not bring the subscriber back.
    checkpoints.forget_subscriber(store, queue, name)
    try:
        store.zk.set(path, b"")
    except NoNodeError:
        return Changes()
    _delete_tree(store, path, f"subscriber {name}")
    return Changes(actions=[f"subscriber {name} removed"])


def start_offset(store: Store, queue: QueueRef, shard: int, head: int, spec: SubscriberSpec,
                 expiry_in_order: bool = True) -> int:
    position = spec.start_position
    if position == "latest":
        return head + 1
    if position == "earliest":
        return positions.earliest_batch(store, queue, shard, head, expiry_in_order)
    assert isinstance(position, datetime)
    return positions.batch_at_time(store, queue, shard, head, position, expiry_in_order)


def _describe(position: object) -> str:
    return position.isoformat() if isinstance(position, datetime) else str(position)


def _children(store: Store, path: str) -> list[str]:
    try:
        return list(store.zk.get_children(path))
    except NoNodeError:
        return []


def _create_if_absent(store: Store, path: str, value: bytes) -> bool:
    try:
        store.zk.create(path, value, makepath=True)
        return True
    except NodeExistsError:
        return False


def _subscriber_json(state: SubscriberState) -> bytes:
    """A subscriber's znode data. Unset optional fields stay out (their default is None, so
    nothing changes on reading back): sidecars of the previous version, whose spec refuses
    fields it does not know, still read a subscriber that does not use a newer field
    (`stallAfter`) during a rolling upgrade."""
    return state.model_dump_json(exclude_none=True).encode()
