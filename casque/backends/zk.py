"""ZooKeeper access for asyncio code: a kazoo client from Settings and awaitable calls.

kazoo runs its own I/O thread. `call` runs a kazoo `*_async` method and awaits its result
in the event loop; connection loss and timeouts become `BackendUnavailable` so callers
handle ZooKeeper and Cassandra outages the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, OperationTimeoutError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError

from casque.config import Settings
from casque.errors import BackendUnavailable

T = TypeVar("T")
RETRYABLE = (ConnectionLoss, OperationTimeoutError, SessionExpiredError, KazooTimeoutError)


def connect(settings: Settings, hosts: str | None = None, timeout: float | None = None) -> KazooClient:
    timeout = timeout or settings.zookeeper_session_timeout_seconds
    client = KazooClient(hosts=hosts or settings.zookeeper_hosts, timeout=timeout)
    try:
        client.start(timeout=timeout)
    except KazooTimeoutError as error:
        client.close()
        raise BackendUnavailable(f"ZooKeeper at {settings.zookeeper_hosts} is unreachable") from error
    return client


async def call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await `client.<op>_async(*args)`: e.g. `await call(client.get_async, path)`."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    async_result = method(*args, **kwargs)

    def on_done(result: Any) -> None:
        try:
            value = result.get_nowait()
        except BaseException as error:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, done, None, error)
        else:
            loop.call_soon_threadsafe(_settle, done, value, None)

    async_result.rawlink(on_done)
    try:
        return await done
    except RETRYABLE as error:
        raise BackendUnavailable(f"ZooKeeper: {type(error).__name__}") from error


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
        loop.call_soon_threadsafe(callback, *args)
        return True

    return trampoline
