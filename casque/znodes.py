"""Every ZooKeeper path casque uses, named once.

    {root}/queues/{namespace}/{queue}                         queue config (JSON)
    {root}/queues/{namespace}/{queue}/shards/{shard}/head     published watermark: every batch <= head exists
    {root}/queues/{namespace}/{queue}/shards/{shard}/totals   running totals as of the head ("batch messages bytes")
    {root}/queues/{namespace}/{queue}/subscribers/{sub}       subscriber config (JSON)
        .../subscribers/{sub}/offsets/{shard}                 every message in batches < offset is done ("offset@epoch")
        .../subscribers/{sub}/fences/{shard}                  bumped by every lease acquisition of the shard
        .../subscribers/{sub}/members/{member}                ephemeral: a live consumer (sidecar)
        .../subscribers/{sub}/leases/{shard}                  ephemeral: the member consuming the shard
        .../subscribers/{sub}/seek                            the latest seek request (JSON; empty before any seek)
        .../subscribers/{sub}/cursors/{shard}                 shared delivery: first unclaimed batch ("N@E")
        .../subscribers/{sub}/claims/{shard}/{E}-{start}      shared delivery: a member's claimed batch range (JSON)
    {root}/queues/{namespace}/{queue}/mover                   election of the delayed-message mover
    {root}/queues/{namespace}/{queue}/publishers/{sidecar}    ephemeral: a sidecar that publishes to the queue,
                                                              and the protocol it speaks (JSON)
    {root}/queues/{namespace}/{queue}/redrive                 redrive watermark of a dead-letter queue (JSON, or empty)
    {root}/grants/{namespace}/{queue}                         what the installation granted the queue (JSON,
                                                              casque.engine.grants): outside the namespace's subtree

The installation (the operator, `casque apply`) makes the queue's and the subscriber's znodes
down to the containers its sidecars create in (members, leases, fences, cursors, claims, the
mover, publishers): a namespace's identity may create nowhere else (casque.backends.zkacl).

Heads are decimal integers in the znode data. An offset is "N@E": the batch N and the seek
epoch E of the shard that keys its ack records ("N" alone is epoch 0), so a reader gets both
in one read. Both are written with the znode version as compare-and-set, so that they only
move forward unless a seek says otherwise.

These position znodes (heads, totals, offsets, cursors) are in format 1, bare numbers, as
every release so far wrote them. A later format marks itself with a `#` and its number
after the numbers ("812#2"), so this release refuses it (NewerFormat, naming it) rather
than read its numbers as format 1's; it writes format 1 only, which every release reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from casque.formats import unmarked
from casque.schema import QueueRef, validate_name


@dataclass(frozen=True)
class QueuePaths:
    root: str
    queue: QueueRef

    @property
    def base(self) -> str:
        return f"{self.root}/queues/{self.queue.namespace}/{self.queue.name}"

    @property
    def shards(self) -> str:
        return f"{self.base}/shards"

    def head(self, shard: int) -> str:
        return f"{self.shards}/{shard}/head"

    def totals(self, shard: int) -> str:
        """The shard's running totals as of its head, written with it (casque.engine.heads)."""
        return f"{self.shards}/{shard}/totals"

    @property
    def subscribers(self) -> str:
        return f"{self.base}/subscribers"

    def subscriber(self, name: str) -> SubscriberPaths:
        return SubscriberPaths(self, validate_name("subscriber", name))

    @property
    def mover(self) -> str:
        return f"{self.base}/mover"

    @property
    def redrive(self) -> str:
        return f"{self.base}/redrive"

    @property
    def publishers(self) -> str:
        return f"{self.base}/publishers"

    def publisher(self, sidecar: str) -> str:
        return f"{self.publishers}/{sidecar}"

    @property
    def grant(self) -> str:
        return f"{self.root}/grants/{self.queue.namespace}/{self.queue.name}"


@dataclass(frozen=True)
class SubscriberPaths:
    queue: QueuePaths
    name: str

    @property
    def base(self) -> str:
        return f"{self.queue.subscribers}/{self.name}"

    @property
    def offsets(self) -> str:
        return f"{self.base}/offsets"

    def offset(self, shard: int) -> str:
        return f"{self.offsets}/{shard}"

    @property
    def fences(self) -> str:
        return f"{self.base}/fences"

    def fence(self, shard: int) -> str:
        return f"{self.fences}/{shard}"

    @property
    def members(self) -> str:
        return f"{self.base}/members"

    def member(self, member_id: str) -> str:
        return f"{self.members}/{member_id}"

    @property
    def leases(self) -> str:
        return f"{self.base}/leases"

    def lease(self, shard: int) -> str:
        return f"{self.leases}/{shard}"

    @property
    def seek(self) -> str:
        return f"{self.base}/seek"

    @property
    def cursors(self) -> str:
        return f"{self.base}/cursors"

    def cursor(self, shard: int) -> str:
        return f"{self.cursors}/{shard}"

    @property
    def claims_root(self) -> str:
        return f"{self.base}/claims"

    def claims(self, shard: int) -> str:
        return f"{self.claims_root}/{shard}"


def queue_paths(root: str, queue: QueueRef) -> QueuePaths:
    return QueuePaths(root.rstrip("/"), queue)


def queues_root(root: str) -> str:
    return f"{root.rstrip('/')}/queues"


def _format_1(data: bytes | None, default: str, what: str) -> str:
    """A position znode's text, refused if it is marked with a later format (casque.formats)."""
    return unmarked(data.decode() if data else default, what)


def decode_head(data: bytes | None) -> int:
    """The batch of a head znode's data (0: none yet)."""
    return int(_format_1(data, "0", "a head"))


def encode_offset(offset: int, epoch: int = 0) -> bytes:
    return (str(offset) if epoch == 0 else f"{offset}@{epoch}").encode()


def decode_offset(data: bytes | None) -> tuple[int, int]:
    """(offset, epoch) of an offset znode's data."""
    offset, _, epoch = _format_1(data, "1", "an offset or cursor").partition("@")
    return int(offset or 1), int(epoch or 0)


def encode_totals(batch: int, messages: int, size: int) -> bytes:
    return f"{batch} {messages} {size}".encode()


def decode_totals(data: bytes | None) -> tuple[int, int, int] | None:
    """(batch, messages, bytes) of a totals znode's data; None if it holds none."""
    parts = _format_1(data, "", "a shard's totals").split()
    if len(parts) != 3:
        return None
    batch, messages, size = (int(p) for p in parts)
    return batch, messages, size
