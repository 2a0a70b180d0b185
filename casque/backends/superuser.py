"""Replace Cassandra's default superuser by the installation's own login, once per cluster.

A node with PasswordAuthenticator starts with one role, `cassandra`, password `cassandra`,
which anyone who reaches the CQL port can guess. The chart's embedded Cassandra starts that
way; before the operator uses it, `secure_cassandra` (run by `casque secure-cassandra`, the
operator pod's init container):

1. logs in with the installation's login (CASQUE_CASSANDRA_USERNAME/_PASSWORD); if Cassandra
   refuses it, with the default superuser instead;
2. gives `system_auth` the installation keyspace's replication, so that losing one node of
   three loses no login (Cassandra reads and writes roles at a quorum of `system_auth`'s
   replicas: with its default of one replica, that node's loss locks everybody out). This
   comes first: a role written while `system_auth` had one replica would, after the change,
   be on one of three, and a quorum read could miss it. The rows already there (the default
   superuser's) are still on their old replica alone, so a quorum read of a role may meet
   two new, empty replicas and find no role (Cassandra then refuses even a superuser,
   `Unauthorized`): before any other statement, a read of every `system_auth` table at ALL
   compares every replica and writes what one lacks (blocking read repair), and statements
   refused meanwhile are sent again for a while (nodes cache a role they did not find);
3. as the default superuser only: creates the installation's role, a superuser with the
   installation's password (or sets that password, if the role exists: the default
   superuser still working means a set-up that stopped half-way, and the Secret is the truth);
4. logs in as the installation, which proves the role works, and takes the default
   superuser's login and superuser status away, with a random password nobody keeps. It is
   not dropped: with no role at all a node would make it again.

Every step is idempotent, so a second run (every operator start) changes nothing, and two
replicas running it at once both end with the same state: the one that loses the race meets a
default superuser that no longer logs in, fails, and its next attempt logs in as the
installation. If Cassandra refuses both logins, the role exists with another password than
the installation's (e.g. the chart's Secret was deleted and made anew): `AccessDenied`, saying
so; setting the role's password back is an administrator's job (docs/security.md).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from cassandra import ConsistencyLevel, OperationTimedOut, ReadTimeout, Unauthorized, Unavailable
from cassandra.cluster import Cluster, Session
from cassandra.query import SimpleStatement
from pydantic import SecretStr

from casque.backends.cql import connect
from casque.config import ReplicationSettings, Settings
from casque.errors import AccessDenied, BackendUnavailable, InvalidSettings

DEFAULT_SUPERUSER = "cassandra"
DEFAULT_PASSWORD = "cassandra"
AUTH_KEYSPACE = "system_auth"
# How long a statement of the set-up is sent again while Cassandra refuses a superuser:
# until system_auth's replicas agree (module docstring, step 2) and the nodes' role caches
# (2 s by default) have let go of a role they did not find.
REFUSED_RETRY_SECONDS = 60.0
REFUSED_PAUSE_SECONDS = 0.5


@dataclass(frozen=True)
class Secured:
    """What a run changed."""

    role_created: bool
    default_disabled: bool
    replication_changed: bool


def quote_identifier(name: str) -> str:
    """A role name as a CQL quoted identifier (case kept, `"` doubled)."""
    return '"' + name.replace('"', '""') + '"'


def wanted_replication(replication: ReplicationSettings) -> dict[str, str]:
    """`system_auth`'s replication as system_schema.keyspaces shows it: the installation
    keyspace's own (one replica per node, at most three, for the chart's embedded ring)."""
    if replication.strategy == "SimpleStrategy":
        return {"class": "org.apache.cassandra.locator.SimpleStrategy", "replication_factor": str(replication.factor)}
    if not replication.datacenters:
        raise InvalidSettings("CASQUE_REPLICATION_DATACENTERS is empty: NetworkTopologyStrategy needs a datacenter")
    return {"class": "org.apache.cassandra.locator.NetworkTopologyStrategy",
            **{dc: str(factor) for dc, factor in replication.datacenters.items()}}


def replication_differs(current: dict[str, str], wanted: dict[str, str]) -> bool:
    """Whether `current` (system_schema's map) places replicas otherwise than `wanted`; the
    class may be given with or without its package."""
    def normal(replication: dict[str, str]) -> dict[str, str]:
        return {key: value.rsplit(".", 1)[-1] if key == "class" else value for key, value in replication.items()}
    return normal(current) != normal(wanted)


def missing_nodes(wanted: dict[str, str], up_per_datacenter: dict[str, int]) -> str | None:
    """Why the replication cannot be applied yet, if it cannot: a datacenter with fewer nodes
    up than the replicas it is to hold would refuse every login at a quorum."""
    if wanted["class"].endswith("SimpleStrategy"):
        needed, have = int(wanted["replication_factor"]), sum(up_per_datacenter.values())
        return None if have >= needed else f"{needed} nodes up, {have} are"
    for dc, factor in wanted.items():
        if dc != "class" and up_per_datacenter.get(dc, 0) < int(factor):
            return f"{factor} nodes up in datacenter {dc}, {up_per_datacenter.get(dc, 0)} are"
    return None


def _execute(session: Session, query: str | SimpleStatement, parameters: tuple[object, ...] | None = None) -> Any:
    """Execute one idempotent statement of the set-up, again while Cassandra refuses it as
    `Unauthorized` (module docstring, step 2); a replica set that does not answer is
    `BackendUnavailable` (retry later)."""
    deadline = time.monotonic() + REFUSED_RETRY_SECONDS
    while True:
        try:
            return session.execute(query, parameters)
        except Unauthorized:
            if time.monotonic() >= deadline:
                raise
            time.sleep(REFUSED_PAUSE_SECONDS)
        except (Unavailable, ReadTimeout, OperationTimedOut) as error:
            raise BackendUnavailable(f"Cassandra: {type(error).__name__}: {error}") from error


def _copy_auth_to_every_replica(session: Session) -> None:
    """Read every `system_auth` table whole at ALL, so that every replica holds every role
    (module docstring, step 2). Needs every replica up."""
    for table in sorted(session.cluster.metadata.keyspaces[AUTH_KEYSPACE].tables):
        statement = SimpleStatement(f"SELECT * FROM {AUTH_KEYSPACE}.{table}", consistency_level=ConsistencyLevel.ALL)
        for _ in _execute(session, statement):
            pass


def _ensure_replication(session: Session, settings: Settings) -> bool:
    wanted = wanted_replication(settings.replication)
    row = _execute(session, "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name = %s",
                          (AUTH_KEYSPACE,)).one()
    if row is not None and not replication_differs(dict(row.replication), wanted):
        return False
    up: dict[str, int] = {}
    for host in session.cluster.metadata.all_hosts():
        if host.is_up and host.datacenter:
            up[host.datacenter] = up.get(host.datacenter, 0) + 1
    waiting = missing_nodes(wanted, up)
    if waiting is not None:
        raise BackendUnavailable(f"{AUTH_KEYSPACE} is to have the replication {settings.replication.cql_map()}, "
                                 f"which needs {waiting}")
    _execute(session, f"ALTER KEYSPACE {AUTH_KEYSPACE} WITH replication = {settings.replication.cql_map()}")
    return True


def _connect_as(settings: Settings, username: str, password: str) -> tuple[Cluster, Session]:
    # model_copy does not validate: the default superuser's password is shorter than the
    # minimum casque asks of the installation's.
    return connect(settings.model_copy(update={"cassandra_username": username,
                                               "cassandra_password": SecretStr(password)}))


def secure_cassandra(settings: Settings) -> Secured:
    """Make the installation's login the cluster's superuser and disable the default one
    (module docstring). Raises `AccessDenied` when neither login works, `BackendUnavailable`
    while Cassandra, or enough of its nodes, cannot be reached (retry)."""
    username, password = settings.cassandra_username, settings.cassandra_password
    if not username or password is None:
        raise InvalidSettings("casque secure-cassandra needs CASQUE_CASSANDRA_USERNAME and CASQUE_CASSANDRA_PASSWORD: "
                              "the installation's login, which replaces the default superuser")
    if username == DEFAULT_SUPERUSER:
        raise InvalidSettings(f"CASQUE_CASSANDRA_USERNAME must not be {DEFAULT_SUPERUSER!r}: that role is disabled")
    role = quote_identifier(username)
    created = replication_changed = False
    try:
        cluster, session = connect(settings)
    except AccessDenied:
        try:
            default_cluster, default_session = _connect_as(settings, DEFAULT_SUPERUSER, DEFAULT_PASSWORD)
        except AccessDenied as error:
            raise AccessDenied(
                f"Cassandra refused the installation's login {username!r} and the default superuser: either the "
                f"role {username!r} exists with another password than CASQUE_CASSANDRA_PASSWORD (was the Secret "
                "made anew? Set the role's password to the Secret's, or the Secret's to the role's), or a new node "
                "has not made its default superuser yet"
            ) from error
        try:
            replication_changed = _ensure_replication(default_session, settings)
            # Also when an earlier run changed the replication and stopped before it was done.
            _copy_auth_to_every_replica(default_session)
            existed = _execute(default_session, "SELECT role FROM system_auth.roles WHERE role = %s",
                                              (username,)).one() is not None
            _execute(default_session, f"CREATE ROLE IF NOT EXISTS {role} "
                                    "WITH SUPERUSER = true AND LOGIN = true AND PASSWORD = %s",
                                    (password.get_secret_value(),))
            if existed:
                _execute(default_session, f"ALTER ROLE {role} WITH SUPERUSER = true AND LOGIN = true AND PASSWORD = %s",
                                        (password.get_secret_value(),))
            created = not existed
        finally:
            default_cluster.shutdown()
        cluster, session = connect(settings)
    try:
        replication_changed = _ensure_replication(session, settings) or replication_changed
        disabled = _disable_default(session)
    finally:
        cluster.shutdown()
    return Secured(role_created=created, default_disabled=disabled, replication_changed=replication_changed)


def _disable_default(session: Session) -> bool:
    row: Any = _execute(session, "SELECT can_login, is_superuser FROM system_auth.roles WHERE role = %s",
                               (DEFAULT_SUPERUSER,)).one()
    if row is None or not (row.can_login or row.is_superuser):
        return False
    _execute(session, f"ALTER ROLE {DEFAULT_SUPERUSER} WITH LOGIN = false AND SUPERUSER = false AND PASSWORD = %s",
                    (secrets.token_urlsafe(32),))
    return True
