"""A shard's running totals (messages, bytes) as of a batch, for the next claim and for stats.

Every batch header carries them, but a header expires with its batch: a queue idle past its
retention has no header left at its head, and a claim that built on nothing would carry no
totals, nor would every claim after it. So a publisher's head advance also writes the totals
of the batch it names to the shard's totals znode (casque.engine.heads), which does not
expire; the header is read first (it is always right), the znode only when the header is
gone, and only when it names that very batch.
"""

from __future__ import annotations

from kazoo.exceptions import NoNodeError

from casque.backends import zk
from casque.engine.batches import Header, Log
from casque.store import Store
from casque.znodes import decode_totals

Totals = tuple[int, int]


def of_header(header: Header | None) -> Totals | None:
    if header is None or header.total_messages is None or header.total_bytes is None:
        return None
    return header.total_messages, header.total_bytes


async def kept(store: Store, log: Log, shard: int, batch: int) -> Totals | None:
    """The totals znode's copy, if it is of `batch`."""
    try:
        data, _ = await zk.call(store.zk.get_async, store.paths(log.queue).totals(shard))
    except NoNodeError:
        return None  # a queue whose publishers predate the znode
    found = decode_totals(data)
    return None if found is None or found[0] != batch else (found[1], found[2])


async def as_of(store: Store, log: Log, shard: int, batch: int, serial: bool = False) -> Totals | None:
    """The totals as of `batch` (0: none yet): its header's, or the znode's once it expired."""
    if batch <= 0:
        return 0, 0
    totals = of_header(await log.read_header(shard, batch, serial=serial))
    return totals if totals is not None else await kept(store, log, shard, batch)
