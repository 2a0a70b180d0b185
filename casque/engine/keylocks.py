"""Ordered keys: the next message of a key is delivered only once the one before it is done.

Pure logic, no I/O. One KeyLocks per shard per member holds, for each key, the positions of
its messages that this member has loaded and not finished (acked or dead-lettered); a message
may be handed out only when it is the first of them. A nacked or expired message keeps its
place, so the messages after it wait for it.

Each loaded copy of a message holds its position under its holder's token (one per
ShardState): a member that gives a range up and takes it back loads the same positions
again while the old state may still release its own, and each release frees only its own
copy. Held by position alone, two releases of one position counted once and a copy stayed
open for good, stopping the key at that member.

In shared delivery, earlier messages of a key may sit in a range another member holds.
Ranges carry the hashes of their keys (casque.engine.claims), so `foreign(batch)` answers the
key hashes of other members' open ranges below `batch`, or None when one of them is not
known yet; then nothing keyed is handed out until it is. A hash collision only holds a
message back longer than needed; it never lets one through early.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import itertools
from collections.abc import Callable, Iterable

from casque.engine.messages import Position

# Key hashes of other members' open ranges below a batch; None while one of them is unknown.
ForeignKeys = Callable[[int], Iterable[frozenset[int]] | None]


class Hold(enum.Enum):
    """Why a keyed message may or may not be handed out now."""

    NONE = "none"
    # Behind an earlier message of its key that this member holds: it comes as the app acks.
    HERE = "here"
    # Behind another member's open range below it, or one not known yet: it waits on others.
    ELSEWHERE = "elsewhere"


# A key's heap is rebuilt without its finished positions once they are more than half of it
# (and more than this): a message finished while an earlier one of its key stays open (a
# filter drops it, say) would otherwise stay in the heap for as long as that one does.
PRUNE_FLOOR = 32

# A holder's position as the locks keep it: (batch, seq, holder token).
Held = tuple[int, int, int]

_tokens = itertools.count(1)


def holder_token() -> int:
    """A token no other holder of key locks in this process has (casque.engine.shard_state)."""
    return next(_tokens)


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big")


class KeyLocks:
    def __init__(self, foreign: ForeignKeys | None = None, on_release: Callable[[], None] = lambda: None) -> None:
        self._foreign = foreign
        self._on_release = on_release
        # key -> heap of the copies loaded here and not done; finished ones are dropped lazily.
        self._pending: dict[str, list[Held]] = {}
        self._finished: dict[str, set[Held]] = {}
        # key -> its first open position here, as `hold` last found it held back by another
        # member's range (`waits_elsewhere`).
        self._first_elsewhere: dict[str, tuple[int, int]] = {}

    def add(self, key: str | None, position: Position, holder: int) -> None:
        """`holder` loaded the message (a token of casque.engine.keylocks.holder_token)."""
        if key is None:
            return
        heapq.heappush(self._pending.setdefault(key, []), (position.batch, position.seq, holder))

    def release(self, key: str | None, position: Position, holder: int) -> None:
        """The message is done at `holder` (acked, dead-lettered) or no longer its (its range
        went elsewhere). Releasing a copy twice, or one never added, changes nothing."""
        if key is None or key not in self._pending:
            return
        finished = self._finished.setdefault(key, set())
        finished.add((position.batch, position.seq, holder))
        if self._first(key) is not None and len(finished) > max(PRUNE_FLOOR, len(self._pending[key]) // 2):
            heap = [item for item in self._pending[key] if item not in finished]
            heapq.heapify(heap)
            self._pending[key] = heap
            finished.clear()
        self._on_release()

    def hold(self, key: str | None, position: Position) -> Hold:
        if key is None:
            return Hold.NONE
        if self._first(key) != (position.batch, position.seq):
            return Hold.HERE
        if self._foreign is None:
            return Hold.NONE
        ranges = self._foreign(position.batch)
        wanted = key_hash(key)
        if ranges is None or any(wanted in keys for keys in ranges):
            self._first_elsewhere[key] = (position.batch, position.seq)
            return Hold.ELSEWHERE
        self._first_elsewhere.pop(key, None)
        return Hold.NONE

    def waits_elsewhere(self, key: str | None) -> bool:
        """Whether the key's messages here wait, through its first one, on another member's
        range: its first open position was held back elsewhere when `hold` last looked at it."""
        if key is None:
            return False
        first = self._first_elsewhere.get(key)
        return first is not None and first == self._first(key)

    def _first(self, key: str) -> tuple[int, int] | None:
        heap = self._pending.get(key)
        finished = self._finished.get(key, set())
        while heap and heap[0] in finished:
            finished.discard(heapq.heappop(heap))
        if not heap:
            self._pending.pop(key, None)
            self._finished.pop(key, None)
            self._first_elsewhere.pop(key, None)
            return None
        batch, seq, _ = heap[0]
        return batch, seq

    @property
    def keys_held(self) -> int:
        return len(self._pending)

    @property
    def positions_kept(self) -> int:
        """Positions held for all keys, open and finished-not-yet-dropped: at most about twice
        the open ones (which are loaded messages, in the prefetch budget) plus PRUNE_FLOOR a key."""
        return sum(len(heap) for heap in self._pending.values()) + sum(map(len, self._finished.values()))
