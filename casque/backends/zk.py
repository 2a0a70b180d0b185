"""ZooKeeper access for asyncio code: a kazoo client from Settings and awaitable calls.

kazoo runs its own I/O thread. `call` runs a kazoo `*_async` method and awaits its result
in the event loop; connection loss and timeouts become `BackendUnavailable` so callers
handle ZooKeeper and Cassandra outages the same way.

The session timeout a client asks for is not the one its session lives by: the server
grants one within its [minSessionTimeout, maxSessionTimeout] (by default 2 to 20 ticks)
and expires the session on that. `granted_session_seconds` is what the server granted at
the client's last connect, the only timeout that may bound a trust in the session (lease
fencing, casque.engine.leases). Clients from `connect` keep it, and log a warning when a
connect grants less than was asked (once per grant, not at every reconnect).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    AuthFailedError,
    ConnectionLoss,
    NoAuthError,
    NoNodeError,
    OperationTimeoutError,
    QuotaExceededError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Connect
from kazoo.protocol.states import KeeperState
from kazoo.retry import KazooRetry

from casque.backends.loop_handoff import call_soon_unless_closed
from casque.backends.tls import client_context, probe
from casque.backends.zkacl import AclClient, Identity, Scheme, installation_policy, namespace_policy, parse_acl
from casque.backends.zkpoll import PollingHandler
from casque.config import Settings
from casque.errors import AccessDenied, BackendUnavailable, InvalidSpec, QuotaExceeded, TlsRefused

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRYABLE = (ConnectionLoss, OperationTimeoutError, SessionExpiredError, KazooTimeoutError)
# kazoo's own reconnection backoff doubles up to an hour: a client cut off from the ensemble
# for 20 s came back up to 25 s after the network healed, one cut off for minutes as late
# again, long after its session had expired and its member had to rejoin. A connection
# attempt is cheap for the servers; try at least every 2 s.
RECONNECT_MAX_SECONDS = 2.0


def reconnection() -> KazooRetry:
    """The connection retry policy of casque's clients: forever, backing off to RECONNECT_MAX_SECONDS."""
    return KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=RECONNECT_MAX_SECONDS)


def identities(settings: Settings) -> list[Identity]:
    """The identities of `settings` (digest, or SASL with CASQUE_ZOOKEEPER_SASL): none without
    credentials; the current one, and the previous one while a rotation is under way."""
    if settings.zookeeper_username is None or settings.zookeeper_password is None:
        return []
    passwords = [settings.zookeeper_password, settings.zookeeper_previous_password]
    scheme: Scheme = "sasl" if settings.zookeeper_sasl else "digest"
    return [Identity(settings.zookeeper_username, p.get_secret_value(), scheme) for p in passwords if p is not None]


def login_options(own: Sequence[Identity]) -> dict[str, Any]:
    """KazooClient's authentication arguments for `own` (the current identity first).

    Digest credentials are all sent on every connect (ZooKeeper accepts any digest; the ACLs
    decide). A SASL login is one exchange with one password, the current one: the servers'
    JAAS file holds one per user.
    """
    if not own:
        return {}
    if own[0].scheme == "sasl":
        return {"sasl_options": own[0].sasl_options}
    return {"auth_data": [identity.auth for identity in own]}


def connect(
    settings: Settings, hosts: str | None = None, timeout: float | None = None, namespace: str | None = None
) -> KazooClient:
    """A started client. With credentials in `settings` it authenticates and puts casque's
    ACLs on every znode it creates (casque.backends.zkacl): as the installation identity, or,
    with `namespace`, as that namespace's sidecar, with the ACL of `settings.zookeeper_acl`.
    A sidecar's access to its namespace is checked here, so wrong credentials fail at once
    with `AccessDenied` instead of at its first write."""
    timeout = timeout or settings.zookeeper_session_timeout_seconds
    hosts = hosts or settings.zookeeper_hosts
    own = identities(settings)
    options = {**tls_options(settings), **login_options(own), "connection_retry": reconnection(),
               "handler": PollingHandler()}
    client: KazooClient
    if not own:
        client = KazooClient(hosts=hosts, timeout=timeout, **options)
    elif namespace is not None and settings.zookeeper_acl is not None:
        try:
            acl = parse_acl(settings.zookeeper_acl)
        except ValueError as error:
            raise InvalidSpec(f"CASQUE_ZOOKEEPER_ACL: {error}") from error
        client = AclClient(namespace_policy(settings.zookeeper_root, acl), hosts=hosts, timeout=timeout, **options)
    else:
        # The installation identity (a sidecar run with it too: it computes the same ACLs).
        try:
            policy = installation_policy(settings.zookeeper_root, own, settings.derivation_keys())
        except ValueError as error:  # settings made without validation (model_copy)
            raise InvalidSpec(f"{error}; a namespace's credentials come with CASQUE_ZOOKEEPER_ACL instead (the "
                              "operator writes both into the casque-zookeeper Secret)") from error
        client = AclClient(policy, hosts=hosts, timeout=timeout, **options)
    keep_granted_timeout(client)
    try:
        outcome = start(client, timeout)
    except KazooTimeoutError as error:
        client.close()
        refused = _tls_refusal(settings, hosts)
        if refused is not None:
            raise TlsRefused(refused) from error
        raise BackendUnavailable(f"ZooKeeper at {settings.zookeeper_hosts} is unreachable") from error
    if outcome != "in":
        client.close()
        login = f"the SASL DIGEST-MD5 login of user {settings.zookeeper_username!r}"
        if not settings.zookeeper_sasl:
            raise BackendUnavailable(f"ZooKeeper at {settings.zookeeper_hosts} took the connection but did not "
                                     f"answer within {timeout:g}s")
        if outcome == "login refused":
            raise AccessDenied(f"ZooKeeper at {settings.zookeeper_hosts} refused {login}: a wrong password, or a "
                               "user missing from the `Server` section of the servers' JAAS file")
        raise BackendUnavailable(
            f"ZooKeeper at {settings.zookeeper_hosts} took the connection but did not answer {login} within "
            f"{timeout:g}s: servers without SASL set up (a JAAS file with a `Server` section, authProvider.sasl) "
            "never answer it (docs/security.md)")
    if own and namespace is not None:
        try:
            if settings.zookeeper_acl is None:
                _check_installation(client, settings)
            check_namespace_access(client, settings, namespace)
        except BaseException:
            client.stop()
            client.close()
            raise
    return client


class _GrantKeeper(ConnectionHandler):  # type: ignore[misc]  # kazoo is untyped
    """kazoo's connection handler, keeping the session timeout that each connect granted.

    kazoo (2.11) reads the granted timeout from the ConnectResponse, derives its ping
    interval from it and drops it; the client keeps only what it asked for, and asks for
    that again on every reconnect. Each connect is a negotiation of its own: a reconnect to
    another server of the ensemble is bounded by that server's limits, and a new session
    after an expiry is negotiated anew, so the last grant is the one that counts. Should a
    kazoo release stop passing the Connect through `_invoke`, no grant is ever kept and
    `granted_session_seconds` fails for every client, rather than trust the asked timeout.
    """

    granted_ms: int | None = None
    # When the connection was lost (monotonic), while it is; kept by `keep_granted_timeout`.
    lost_since: float | None = None

    def _connect(self, host: str, hostip: str, port: int) -> Any:
        # A session that no server has heard from for longer than it was granted has expired
        # on every server. Say so before connecting: a server that lost its data (a wiped
        # ensemble) has never seen this client's zxid and refuses its reconnect for good,
        # without ever reporting the expiry (kazoo would try forever); a new session, from
        # zxid 0, is taken. Members learn it as any expiry (LOST) and rejoin.
        lost_since, granted = self.lost_since, self.granted_ms
        if (lost_since is not None and granted is not None and self.client._session_id
                and time.monotonic() - lost_since > granted / 1000):
            log.warning("ZooKeeper: no server answered for %.0fs, longer than the session's %gs: taking the "
                        "session as expired and opening a new one", time.monotonic() - lost_since, granted / 1000)
            self.lost_since = None
            self.client._session_callback(KeeperState.EXPIRED_SESSION)
        return super()._connect(host, hostip, port)

    def _invoke(self, timeout: float, request: Any, xid: int | None = None) -> Any:
        # kazoo sends its Connect through here while it sets a connection up, and returns
        # the server's reply to it.
        reply = super()._invoke(timeout, request, xid)
        if isinstance(request, Connect):
            granted: int = reply[0].time_out
            asked: int = request.time_out
            if granted > 0:  # 0: the session had expired (kazoo raises that next), nothing was granted
                if granted < asked and granted != self.granted_ms:
                    log.warning(
                        "ZooKeeper granted a session timeout of %gs, not the %gs asked for: the servers' "
                        "maxSessionTimeout caps it, and casque trusts sessions for what was granted; set "
                        "CASQUE_ZOOKEEPER_SESSION_TIMEOUT_SECONDS to %g or less, or raise maxSessionTimeout on "
                        "the servers", granted / 1000, asked / 1000, granted / 1000)
                self.granted_ms = granted
        return reply


def keep_granted_timeout(client: KazooClient) -> KazooClient:
    """`client`, made to keep the session timeout each connect grants it (read with
    `granted_session_seconds`), and to take its session as expired once no server has
    answered for longer than that (`_GrantKeeper._connect`); before its start. `connect`
    does it for its clients."""
    handler = client._connection
    if isinstance(handler, _GrantKeeper):
        return client
    if not client._stopped.is_set():
        raise ValueError("keep_granted_timeout needs a client that has not been started")
    keeper = _GrantKeeper(client, handler.retry_sleeper, logger=handler.logger, sasl_options=handler.sasl_options)
    client._connection = keeper

    def on_state(state: str) -> None:
        if state == KazooState.SUSPENDED:
            keeper.lost_since = keeper.lost_since or time.monotonic()
        else:
            keeper.lost_since = None

    client.add_listener(on_state)
    return client


def granted_session_seconds(client: KazooClient) -> float:
    """The session timeout, in seconds, that ZooKeeper granted `client` at its last connect:
    the one the server expires its session on, whatever the client asked for."""
    handler = client._connection
    granted = handler.granted_ms if isinstance(handler, _GrantKeeper) else None
    if granted is None:
        # Falling back to the asked timeout would trust a session longer than it may live.
        raise ValueError("this ZooKeeper client does not know the session timeout the server granted it: "
                         "make it with casque.backends.zk.connect, or keep_granted_timeout before its start")
    return granted / 1000.0


# How a start ended (an unreachable ensemble raises instead): the session is usable; the
# servers refused the SASL login; or a server took the connection but did not answer (with
# SASL: the login; a server without SASL set up logs an error and stays silent).
StartOutcome = Literal["in", "login refused", "unanswered"]


def start(client: KazooClient, timeout: float) -> StartOutcome:
    """Start `client` and wait until its session is usable: connected and, with SASL, logged
    in. KazooTimeoutError (the client stopped) when no server took the connection in time.

    Not kazoo's `start`: kazoo reports a session CONNECTED before its SASL exchange, and a
    refused login then ends the session (AUTH_FAILED, never retried) and drops the requests
    queued meanwhile without answering them, so a first call could wait forever. Here the
    answer to a first request (sent only after the login) or the session's loss, whichever
    comes first, settles it.
    """
    reached, settled = threading.Event(), threading.Event()
    refused = threading.Event()

    def on_state(state: str) -> bool:
        if state == KazooState.CONNECTED:
            reached.set()
        elif state == KazooState.LOST:
            # Called in the same step that set the session's state, so this is the reason.
            if client.client_state == KeeperState.AUTH_FAILED:
                refused.set()
            reached.set()
            settled.set()
        return False

    deadline = time.monotonic() + timeout
    client.add_listener(on_state)
    answered = None
    try:
        client.start_async()
        if reached.wait(timeout) and not settled.is_set():
            answered = client.exists_async("/")
            answered.rawlink(lambda _: settled.set())
            settled.wait(max(0.0, deadline - time.monotonic()))
    finally:
        client.remove_listener(on_state)
    if answered is not None and answered.successful():
        return "in"
    client.stop()
    if refused.is_set():
        return "login refused"
    if reached.is_set():
        return "unanswered"
    raise KazooTimeoutError("Connection time-out")


def tls_options(settings: Settings) -> dict[str, Any]:
    """KazooClient's TLS arguments (none when TLS is off)."""
    tls = settings.zookeeper_tls
    if not tls.enabled:
        return {}
    # kazoo builds its context per connection from these; building one here first checks
    # the files once, with an error that names the setting.
    client_context(tls, "ZooKeeper")
    return {
        "use_ssl": True,
        "ca": str(tls.ca_file) if tls.ca_file else None,
        "certfile": str(tls.cert_file) if tls.cert_file else None,
        "keyfile": str(tls.key_file) if tls.key_file else None,
        "verify_certs": True,
        "check_hostname": tls.verify_hostname,
    }


def _tls_refusal(settings: Settings, hosts: str) -> str | None:
    """Why TLS failed, if that is why the client never connected: kazoo retries a refused
    handshake like a lost connection until its start times out."""
    tls = settings.zookeeper_tls
    if not tls.enabled:
        return None
    context = client_context(tls, "ZooKeeper")
    for server in hosts.split("/", 1)[0].split(","):
        host, _, port = server.strip().rpartition(":")
        reason = probe(context, host.strip("[]"), int(port or 2181))
        if reason is not None:
            return f"ZooKeeper at {server.strip()}: {reason}"
    return None


def _check_installation(client: KazooClient, settings: Settings) -> None:
    """A sidecar with credentials but no ACL must hold the installation identity: with a
    namespace's, it would create znodes that only the namespace could use."""
    try:
        client.get_children(f"{settings.zookeeper_root.rstrip('/')}/queues")
    except NoAuthError as error:
        raise AccessDenied(
            f"user {settings.zookeeper_username!r} is not the installation's: a namespace's ZooKeeper "
            "credentials need CASQUE_ZOOKEEPER_ACL too (the operator writes both into the casque-zookeeper Secret)"
        ) from error
    except NoNodeError:
        pass  # a new installation: nothing to protect yet
    except RETRYABLE as error:
        raise BackendUnavailable(f"ZooKeeper: {type(error).__name__}") from error


def check_namespace_access(client: KazooClient, settings: Settings, namespace: str) -> None:
    path = f"{settings.zookeeper_root.rstrip('/')}/queues/{namespace}"
    try:
        # Listing needs READ, which only the namespace's own identity (and the
        # installation's) has, so a sidecar given another namespace's credentials stops here.
        client.get_children(path)
    except NoAuthError as error:
        raise AccessDenied(
            f"ZooKeeper refused user {settings.zookeeper_username!r} access to namespace {namespace!r} "
            f"({path}): these credentials belong to another namespace, or are out of date; "
            f"use the casque-zookeeper Secret of namespace {namespace!r}"
        ) from error
    except NoNodeError as error:
        raise BackendUnavailable(
            f"namespace {namespace!r} has no queue yet ({path} does not exist): the operator creates it "
            "with the namespace's first Queue"
        ) from error
    except RETRYABLE as error:
        raise BackendUnavailable(f"ZooKeeper: {type(error).__name__}") from error


async def call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await `client.<op>_async(*args)`: e.g. `await call(client.get_async, path)`."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    async_result = method(*args, **kwargs)

    def on_done(result: Any) -> None:
        try:
            value = result.get_nowait()
        except BaseException as error:  # handed to the awaiting coroutine
            call_soon_unless_closed(loop, _settle, done, None, error)
        else:
            call_soon_unless_closed(loop, _settle, done, value, None)

    async_result.rawlink(on_done)
    try:
        return await done
    except RETRYABLE as error:
        raise BackendUnavailable(f"ZooKeeper: {type(error).__name__}") from error
    except NoAuthError as error:
        raise AccessDenied(f"ZooKeeper refused this identity the operation on {_path_of(args)}") from error
    except QuotaExceededError as error:
        raise over_quota(_path_of(args)) from error
    except AuthFailedError as error:
        # The session's SASL login was refused on a reconnect (a password changed on the
        # servers): kazoo ends such a session for good, so only a new client gets back in.
        raise AccessDenied("ZooKeeper refused this client's login; it must reconnect with valid credentials") from error


def over_quota(where: str) -> QuotaExceeded:
    """ZooKeeper refused a create or write past a hard quota: its namespace's (casque.engine.znode_quotas)."""
    return QuotaExceeded(f"ZooKeeper refused a write at {where}: the namespace's znodes would pass its quota "
                         "(quota.casque.io/max-znodes, quota.casque.io/max-znode-bytes)")


def _path_of(args: tuple[Any, ...]) -> str:
    return args[0] if args and isinstance(args[0], str) else "a transaction"


def _settle(done: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(value)


def watch_in_loop(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., None], active: Callable[[], bool]
) -> Callable[..., bool]:
    """A kazoo watch function that runs `callback` in `loop` instead of kazoo's thread.

    kazoo passes DataWatch functions (data, stat, event) and ChildrenWatch functions
    (children); `callback` receives whatever was passed. Once `active()` is false the watch
    function returns False, which tells kazoo to drop the watch.
    """

    def trampoline(*args: Any) -> bool:
        if not active() or loop.is_closed():
            return False
        call_soon_unless_closed(loop, callback, *args)
        return True

    return trampoline
