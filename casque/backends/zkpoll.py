"""kazoo's connection thread waiting with one poll(2) call, not a new epoll selector per wait.

kazoo's threading handler waits for its socket through `selector_select`, which builds a
`selectors.DefaultSelector` for every wait: an epoll descriptor created, the socket and the
wake-up pipe registered, one wait, the descriptor closed. kazoo waits before every request
it writes and for every reply, so a sidecar paid that for each ZooKeeper operation (a head
write per batch published, the watch reads it sets off): 17 µs per wait against 1.3 µs for
poll(2), and py-spy showed the selector's creation, registration and closing in the
ZooKeeper thread while publishing. `PollingHandler.select` answers as `selector_select`
does: the same arguments, the same errors, the same lists, an object that is both readable
and writable (or hung up) reported readable only; poll, like epoll, has no limit on
descriptor numbers, which is why kazoo left select(2). One difference: a descriptor closed
by another thread between kazoo's fileno() and the wait is reported readable (POLLNVAL),
so kazoo's read fails and it reconnects, where registering it with epoll raised ValueError.
"""

from __future__ import annotations

import math
import select
from collections.abc import Sequence
from typing import Any

from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd

# As selectors.PollSelector reads poll's events: any event but POLLOUT alone makes a
# descriptor readable (a hang-up, an error), any but POLLIN alone writable.
_READ, _WRITE = 1, 2


class PollingHandler(SequentialThreadingHandler):  # type: ignore[misc]  # kazoo is untyped
    def select(self, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any], list[Any]]:
        return poll_select(*args, **kwargs)


def poll_select(rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any],
                timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
    """`kazoo.handlers.utils.selector_select`, waiting with poll(2)."""
    if timeout is not None:
        if not isinstance(timeout, (int, float)):
            raise TypeError("timeout must be a number")
        if timeout < 0:
            raise ValueError("timeout must be non-negative")
    wanted: dict[int, int] = {}
    objects: dict[int, list[Any]] = {}
    for event, fileobjs in ((_READ, rlist), (_WRITE, wlist)):
        for fileobj in fileobjs:
            fd = fileobj_to_fd(fileobj)
            wanted[fd] = wanted.get(fd, 0) | event
            objects.setdefault(fd, []).append(fileobj)
    poller = select.poll()
    for fd, events in wanted.items():
        try:
            poller.register(fd, (select.POLLIN if events & _READ else 0) | (select.POLLOUT if events & _WRITE else 0))
        except (ValueError, OSError) as error:
            raise ValueError("Invalid event mask or fd") from error
    ready = poller.poll(None if timeout is None else math.ceil(timeout * 1000))
    readable: list[Any] = []
    writable: list[Any] = []
    for fd, polled in ready:
        events = 0
        if polled & ~select.POLLOUT:
            events |= _READ
        if polled & ~select.POLLIN:
            events |= _WRITE
        events &= wanted.get(fd, 0)
        if events & _READ:
            readable.extend(objects[fd])
        elif events & _WRITE:
            writable.extend(objects[fd])
    return readable, writable, []
