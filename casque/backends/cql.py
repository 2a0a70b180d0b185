"""Cassandra access for asyncio code: a session from Settings and awaitable statements.

The driver runs its I/O on its own threads; `execute` bridges a ResponseFuture into the
running event loop without blocking it. Driver errors are mapped once, here, to casque's
own errors (a timeout or an unavailable replica set is `BackendUnavailable`: retryable).
"""

from __future__ import annotations

import asyncio
import socket
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from cassandra import (
    AuthenticationFailed,
    ConsistencyLevel,
    CoordinationFailure,
    DriverException,
    OperationTimedOut,
    ReadTimeout,
    Unavailable,
    UnresolvableContactPoints,
    WriteTimeout,
)
from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import (
    EXEC_PROFILE_DEFAULT,
    Cluster,
    ExecutionProfile,
    NoHostAvailable,
    ResponseFuture,
    ResultSet,
    Session,
)
from cassandra.policies import DCAwareRoundRobinPolicy, TokenAwarePolicy
from cassandra.protocol import ErrorMessage, IsBootstrappingErrorMessage, OverloadedErrorMessage
from cassandra.query import (
    UNSET_VALUE,
    BatchStatement,
    BoundStatement,
    PreparedStatement,
    Statement,
    named_tuple_factory,
    tuple_factory,
)

from casque.backends.loop_handoff import call_soon_unless_closed
from casque.backends.rediscovery import NodeWatch, WatchedReconnectionPolicy
from casque.backends.tls import client_context, probe
from casque.config import Settings
from casque.errors import AccessDenied, BackendUnavailable, TlsRefused, WriteOutcomeUnknown

# Protocol v5's CAS_WRITE_UNKNOWN error code (the driver has no class for it).
CAS_WRITE_UNKNOWN = 0x1700

# Everything that means "the cluster did not do it now, it may later": timeouts, too few
# replicas, replica failures (ReadFailure, WriteFailure), an overloaded or bootstrapping
# coordinator. Each becomes `BackendUnavailable`, which callers retry with backoff.
RETRYABLE = (
    WriteTimeout,
    ReadTimeout,
    Unavailable,
    OperationTimedOut,
    NoHostAvailable,
    CoordinationFailure,
    OverloadedErrorMessage,
    IsBootstrappingErrorMessage,
)

# The driver leaves Nagle's algorithm on. A request of a few kilobytes (a batch of a dozen
# messages) then waits for the server's delayed ACK, about 40 ms: ten times the write itself.
SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]

# How long a request waits for its answer before it is retried or fails.
REQUEST_TIMEOUT_SECONDS = 10.0

# How soon a node marked down is tried again. The driver's default doubles from 1 s to 10
# minutes and gives up after 64 attempts: a sidecar cut off from its nodes for a minute
# stayed away about as long again after the network healed, and one cut off long enough
# never came back. A connection attempt to a down node is cheap; keep trying every 2 s.
RECONNECT_BASE_SECONDS = 0.2
RECONNECT_MAX_SECONDS = 2.0

# Whether the driver prepares every statement it knows on a node as it comes up, before the
# node is used. Off: with protocol v5 the driver (3.30) sends its list in chunks of ten but
# sends the chunks so far again after each new one, about N²/20 PREPAREs for N statements
# (a sidecar of one queue holds 20, and each queue's table has statements of its own), on a
# connection of its own, before it opens the node's pools. Cassandra keeps its
# prepared statements across restarts (system.prepared_statements), and a node that lost
# one answers UNPREPARED, which the driver handles by preparing it there and sending the
# request again.
REPREPARE_ON_UP = False


def consistency(name: str) -> int:
    return int(ConsistencyLevel.name_to_value[name])


def serial_consistency(name: str, spans_datacenters: bool = False) -> int:
    """The Paxos consistency of claims for a write consistency: local for LOCAL_* in one
    datacenter; SERIAL whenever the keyspace spans datacenters, because two LOCAL_SERIAL
    rounds in two datacenters can both win the same batch (and merge two batches)."""
    local = name.startswith("LOCAL_") and not spans_datacenters
    return consistency("LOCAL_SERIAL" if local else "SERIAL")


def replicated_datacenters(replication: Mapping[str, str], host_datacenters: Iterable[str | None]) -> int:
    """How many datacenters hold replicas of a keyspace with this `replication` map
    (system_schema.keyspaces), in a cluster whose hosts are in `host_datacenters`.

    NetworkTopologyStrategy names its datacenters; the others place replicas on the ring
    regardless of datacenter, so every datacenter of the cluster may hold some.
    """
    strategy = replication.get("class", "")
    if strategy.endswith("NetworkTopologyStrategy"):
        return sum(1 for dc, factor in replication.items() if dc != "class" and int(factor) > 0)
    return max(1, len({dc for dc in host_datacenters if dc}))


def keyspace_datacenters(session: Session, keyspace: str) -> int:
    """`replicated_datacenters` of a keyspace, as the cluster knows it now."""
    row = session.execute(
        "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name = %s", (keyspace,)
    ).one()
    replication = dict(row.replication) if row is not None else {}
    return replicated_datacenters(replication, (host.datacenter for host in session.cluster.metadata.all_hosts()))


def tls_options(settings: Settings) -> dict[str, Any]:
    """The Cluster's TLS arguments (none when TLS is off)."""
    tls = settings.cassandra_tls
    if not tls.enabled:
        return {}
    options: dict[str, Any] = {"ssl_context": client_context(tls, "Cassandra")}
    if tls.server_hostname is not None:
        # Without it the driver checks each node's certificate against that node's address.
        options["ssl_options"] = {"server_hostname": tls.server_hostname}
    return options


def connect(settings: Settings, schema_of: str | None = None) -> tuple[Cluster, Session]:
    """A cluster and its session. `schema_of`: the one keyspace the process works in (a
    sidecar's): the driver learns that keyspace's replication, for token-aware routing, and
    no other schema (see `_learn_one_keyspace`); None: the whole schema, kept up to date."""
    auth = None
    if settings.cassandra_username:
        password = settings.cassandra_password.get_secret_value() if settings.cassandra_password else ""
        auth = PlainTextAuthProvider(settings.cassandra_username, password)
    profile = ExecutionProfile(
        load_balancing_policy=TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=settings.cassandra_local_dc)),
        consistency_level=consistency(settings.consistency),
        request_timeout=REQUEST_TIMEOUT_SECONDS,
        row_factory=named_rows,
    )
    try:
        cluster = Cluster(
            settings.cassandra_contact_points,
            port=settings.cassandra_port,
            auth_provider=auth,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            protocol_version=5,
            sockopts=SOCKET_OPTIONS,
            reconnection_policy=WatchedReconnectionPolicy(RECONNECT_BASE_SECONDS, RECONNECT_MAX_SECONDS, max_attempts=None),
            reprepare_on_up=REPREPARE_ON_UP,
            schema_metadata_enabled=schema_of is None,
            # The control connection's reads (the nodes, the schema: all of it for a process
            # that works in more than one keyspace, such as the CLI) get a request's time, not
            # the driver's 2 s: a node that slow under load is busy, not down, and a one-shot
            # command would say it is unreachable.
            control_connection_timeout=REQUEST_TIMEOUT_SECONDS,
            **tls_options(settings),
        )
    except UnresolvableContactPoints as error:
        # A Service's name resolves only once it has a ready pod (a headless one), e.g. while
        # the release's own Cassandra starts: retryable, like a node that does not answer yet.
        raise BackendUnavailable(
            f"Cassandra contact points {settings.cassandra_contact_points} do not resolve (yet)") from error
    try:
        session = cluster.connect()
    except NoHostAvailable as error:
        cluster.shutdown()
        # A dict of each host's error; a list of hosts when the session's pools failed after
        # the control connection was made (no reasons then: taken as unavailable, retryable).
        reasons = error.errors if isinstance(error.errors, dict) else {}
        if reasons and all(isinstance(e, AuthenticationFailed) for e in reasons.values()):
            raise AccessDenied(
                f"Cassandra refused user {settings.cassandra_username!r}: wrong credentials, "
                "or the server does not authenticate with passwords"
            ) from error
        refused = _tls_refusal(settings)
        if refused is not None:
            raise TlsRefused(refused) from error
        raise BackendUnavailable(f"Cassandra at {settings.cassandra_contact_points} is unreachable: {error}") from error
    NodeWatch(cluster, settings.cassandra_contact_points, settings.cassandra_port, settings.cassandra_local_dc).start()
    if schema_of is not None:
        _learn_one_keyspace(cluster, schema_of)
    return cluster, session


def _learn_one_keyspace(cluster: Cluster, keyspace: str) -> None:
    """The driver's schema metadata for `keyspace` alone.

    By default the driver holds the metadata of every keyspace and table of the cluster and
    reads it again after each schema change: memory and work that grow with every tenant's
    queues, in every pod's sidecar (1.5 MiB of RSS with the system keyspaces and one of
    casque's, 3.5 MiB at 30 keyspaces). Token-aware routing needs only the keyspace's replication, and prepared
    statements bring their own routing columns. A replication changed later is not seen
    (the coordinator still routes; a restart learns it), as `Store.spans_datacenters`.
    A keyspace that does not exist yet is learnt when it is made: the whole schema is then
    kept, as by default.
    """
    try:
        cluster.refresh_keyspace_metadata(keyspace)
        if keyspace not in cluster.metadata.keyspaces:
            cluster.schema_metadata_enabled = True
            cluster.refresh_schema_metadata()
    except DriverException as error:
        cluster.shutdown()
        raise BackendUnavailable(f"Cassandra did not answer for the schema of keyspace {keyspace}: {error}") from error


def _tls_refusal(settings: Settings) -> str | None:
    """Why TLS failed, if that is why no host was available: the driver reports a refused
    handshake as one more unavailable host (and a plaintext client to a TLS port as a
    connection cut short), so one handshake is repeated to tell."""
    tls = settings.cassandra_tls
    if not tls.enabled:
        return None
    host = settings.cassandra_contact_points[0]
    reason = probe(client_context(tls, "Cassandra"), host, settings.cassandra_port, tls.server_hostname)
    return None if reason is None else f"Cassandra at {host}:{settings.cassandra_port}: {reason}"


# The row classes of `named_rows`, by the column names of a result. Statements are few and
# fixed; the bound only keeps an unforeseen stream of ad-hoc column lists from growing it.
_ROW_CLASSES: dict[tuple[str, ...], type[tuple[Any, ...]]] = {}
_ROW_CLASSES_MAX = 512


def named_rows(colnames: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[Any]:
    """Rows as the driver's `named_tuple_factory` makes them (the same names, cleaned the
    same way), with the row class made once per column list.

    The driver's factory makes a new namedtuple class for every result with rows, about
    30 µs on its I/O thread, which holds the GIL the event loop needs: once for every
    conditional write (a batch's claim), every header or offset read. Runs on the driver's
    I/O threads: a dict read or write is atomic under the GIL, and two threads making the
    same class at once make two equal ones.
    """
    if not rows:
        return []
    names = tuple(colnames)
    row_class = _ROW_CLASSES.get(names)
    if row_class is None:
        (first, *_) = named_tuple_factory(colnames, rows[:1])
        row_class = type(first)
        if len(_ROW_CLASSES) >= _ROW_CLASSES_MAX:
            _ROW_CLASSES.clear()
        _ROW_CLASSES[names] = row_class
    return [row_class(*row) for row in rows]


def applied(result: ResultSet) -> bool:
    """Whether a conditional write (or a batch holding one) was applied. The driver's
    `ResultSet.was_applied` answers for its own row factories only, not for `named_rows`."""
    names = result.column_names
    if not names or names[0] != "[applied]":
        raise RuntimeError(f"not the result of a conditional write (columns {names})")
    return bool(result.current_rows[0][0])


# Each session's default execution profile with rows as plain tuples (see `tuple_rows`).
_TUPLE_ROWS: weakref.WeakKeyDictionary[Session, ExecutionProfile] = weakref.WeakKeyDictionary()


def tuple_rows(session: Session) -> ExecutionProfile:
    """The session's default execution profile, but with rows as plain tuples in the order
    the query names its columns.

    For the reads of every message (a consumer's log reads): named tuples cost a class
    built per page and a Python-level constructor call per row, on the driver's I/O thread,
    which holds the GIL the event loop needs. A shallow copy shares the default profile's
    load-balancing policy, so it needs no registering with the cluster.
    """
    profile = _TUPLE_ROWS.get(session)
    if profile is None:
        profile = _TUPLE_ROWS[session] = session.execution_profile_clone_update(
            EXEC_PROFILE_DEFAULT, row_factory=tuple_factory)
    return profile


class BatchRows:
    """Rows of one prepared statement added to batches, their values serialized here.

    `BatchStatement.add(prepared, values)` binds each row through a new BoundStatement and,
    per value, a column descriptor for column encryption (which casque does not use): about
    as much work as the row's own serialization. A group commit adds up to 1,000 rows, so
    here the row's values go through the same column serializers directly, and values
    shared by every row of a batch (`shared`) are serialized once per batch. None is left
    unset, as `casque.engine.batches` binds it (a bound null would write a tombstone).
    """

    def __init__(self, prepared: PreparedStatement) -> None:
        assert prepared.column_encryption_policy is None, "encrypted columns are serialized by the driver only"
        self._version = prepared.protocol_version
        self._serializers = [column.type.serialize for column in prepared.column_metadata]
        # One BoundStatement stands for every row: add() keeps the row's value list, which
        # is new for each row, and reads nothing else of it once the batch has a routing key.
        self._row = BoundStatement(prepared)

    def shared(self, values: Sequence[Any]) -> list[Any]:
        """The first len(values) columns, serialized once for the rows of one batch."""
        return [UNSET_VALUE if v is None else serialize(v, self._version)
                for serialize, v in zip(self._serializers, values)]

    def add(self, batch: BatchStatement, shared: list[Any], values: Sequence[Any]) -> None:
        """Add a row: `shared` (from `shared()`) for its first columns, `values` for the rest.
        The batch must have a routing key already (its first statement added as usual)."""
        version = self._version
        encoded = shared + [UNSET_VALUE if v is None else serialize(v, version)
                            for serialize, v in zip(self._serializers[len(shared):], values)]
        self._row.values = encoded
        batch.add(self._row)


async def execute(
    session: Session, statement: str | Statement, params: Sequence[Any] | None = None,
    profile: str | ExecutionProfile = EXEC_PROFILE_DEFAULT,
) -> Any:
    """Run a statement without blocking the loop; returns the driver's ResultSet.
    `profile`: an execution profile's name, or one such as `tuple_rows(session)`."""
    return await _result(session.execute_async(statement, params, execution_profile=profile))


async def fetch_all(session: Session, statement: str | Statement, params: Sequence[Any] | None = None) -> list[Any]:
    """Every row of a paged query, each page fetched without blocking the loop.

    Iterating a ResultSet past its first page makes the driver fetch the next page
    synchronously, which would stall the event loop for a round trip per page.
    """
    result = await execute(session, statement, params)
    rows = list(result.current_rows)
    while result.has_more_pages:
        response = result.response_future
        # The driver calls a future's callbacks again for every page: drop the last page's
        # before asking for the next one.
        response.clear_callbacks()
        response.start_fetching_next_page()
        result = await _result(response)
        rows.extend(result.current_rows)
    return rows


async def pages(
    session: Session, statement: str | Statement, params: Sequence[Any] | None = None,
    profile: str | ExecutionProfile = EXEC_PROFILE_DEFAULT,
) -> AsyncIterator[list[Any]]:
    """The pages of a query, each fetched without blocking the loop, the next one only when
    asked for: a reader that has enough stops, and the rest is never sent.

    A `fetch_size` the caller sets on the statement between pages applies from the next
    page on: a reader that learns the size of its rows from the first page can ask for
    fewer, larger pages after it.
    """
    result = await execute(session, statement, params, profile)
    yield list(result.current_rows)
    while result.has_more_pages:
        response = result.response_future
        response.clear_callbacks()  # see fetch_all
        wanted = getattr(statement, "fetch_size", None)
        if wanted and response.message.fetch_size != wanted:
            response.message.fetch_size = wanted  # the request the driver sends again for each page
        response.start_fetching_next_page()
        result = await _result(response)
        yield list(result.current_rows)


async def _result(response: ResponseFuture) -> Any:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def on_result(_: Any) -> None:
        call_soon_unless_closed(loop, _settle, done, response, None)

    def on_error(error: BaseException) -> None:
        call_soon_unless_closed(loop, _settle, done, response, error)

    response.add_callbacks(on_result, on_error)
    try:
        return await done
    except WriteTimeout as error:
        raise WriteOutcomeUnknown(f"Cassandra: {type(error).__name__}: {error}") from error
    except RETRYABLE as error:
        raise BackendUnavailable(f"Cassandra: {type(error).__name__}: {error}") from error
    except ErrorMessage as error:
        if error.code == CAS_WRITE_UNKNOWN:
            # Protocol v5: a contended conditional write whose proposal reached some replicas.
            # The driver has no class for it; it may still complete.
            raise WriteOutcomeUnknown(f"Cassandra: CAS write unknown: {error.message}") from error
        raise


def _settle(done: asyncio.Future[Any], response: Any, error: BaseException | None) -> None:
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        # The ResultSet (not only the first page) so callers can read `was_applied` and paging state.
        done.set_result(response.result())
