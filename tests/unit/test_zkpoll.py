"""kazoo's waits through poll(2) answer as kazoo's own selector-based select does."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.handlers.utils import selector_select

from casque.backends.zkpoll import PollingHandler, poll_select


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made = [socket.socketpair() for _ in range(3)]
    yield made
    for a, b in made:
        a.close()
        b.close()


def both(rlist: list[Any], wlist: list[Any], timeout: float | None = 0) -> None:
    assert poll_select(rlist, wlist, [], timeout) == selector_select(rlist, wlist, [], timeout)


def test_the_same_sockets_come_back_as_readable_or_writable(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    (a, b), (c, d), (e, f) = pairs
    both([a, c], [])  # nothing to read
    b.send(b"x")
    both([a, c], [])  # one readable
    both([], [a, c, e])  # all writable
    both([a, c], [a, e])  # a both readable and writable: reported readable only
    both([a, a], [])  # listed twice, reported twice
    f.close()
    both([e], [e])  # hung up: readable
    both([e.fileno(), c], [])  # descriptors as numbers too
    both([c], [], timeout=0.01)  # a wait that times out


def test_bad_arguments_fail_alike(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    (a, _), *_ = pairs
    for args, error in ((([a], [], [], -1), ValueError), (([a], [], [], "1"), TypeError), (([-1], [], []), TypeError),
                        ((["x"], [], []), TypeError)):
        with pytest.raises(error):
            selector_select(*args)
        with pytest.raises(error):
            poll_select(*args)


def test_the_handler_waits_with_poll() -> None:
    assert PollingHandler().select([], [], [], 0) == ([], [], [])
