"""Heaps with lazy deletion, as a shard's state keeps them (casque.engine.shard_state).

An item whose message moved on (extended, nacked, delivered again, done) stays in its heap
and is skipped when it surfaces: nothing scans a heap to remove it. A heap is rebuilt
without its stale items once it holds more than HEAP_SLACK times the live ones plus
HEAP_FLOOR, so no sequence of calls grows one without bound, and small heaps are left alone.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TypeVar

HEAP_SLACK = 4
HEAP_FLOOR = 1024

T = TypeVar("T", bound=tuple[object, ...])


def pruned(heap: list[T], live: int, keep: Callable[[T], bool]) -> list[T]:
    """`heap` itself while it is within bounds for `live` items; otherwise a new heap of the
    items `keep` accepts, each once (a message pushed twice for one state is one item)."""
    if len(heap) <= HEAP_FLOOR + HEAP_SLACK * live:
        return heap
    kept = list(dict.fromkeys(item for item in heap if keep(item)))
    heapq.heapify(kept)
    return kept
