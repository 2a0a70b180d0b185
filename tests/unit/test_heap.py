"""heap.settle: what exists is frozen out of the collector's reach, the young threshold raised."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from casque.sidecar import heap


@pytest.fixture
def restored_collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_collector")
def test_settle_freezes_what_exists_and_collects_the_young_less_often() -> None:
    _, older, oldest = gc.get_threshold()
    node = Node()
    node.self = node
    gone = weakref.ref(node)
    del node  # garbage before the freeze is collected, not kept frozen
    heap.settle()
    assert gone() is None
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, older, oldest)


class Node:
    self: Node | None = None
