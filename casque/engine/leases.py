"""Shard leases: the live consumers of a subscriber share its shards evenly.

Recipe:
- Each consumer registers an ephemeral member znode. Members sorted by id take shards
  round-robin: the i-th shard in order belongs to member i mod n. Every member computes the same
  assignment from the same member list, so no coordinator is needed.
- A member consumes a shard only while it holds the shard's ephemeral lease znode (data:
  its member id). On a membership change it first releases the shards it no longer owns
  (after its callback has flushed acks and offsets), then tries to create the leases of
  its new shards; a lease still held by the previous owner is retried when the lease
  children change. So a shard never has two holders, and moves within one watch round
  trip of a change (a crashed member's leases go when its session expires).

Connection states: SUSPENDED keeps the leases (the session may still be alive) but the
consumer stops handing out messages until CONNECTED again. LOST means the session expired
and ZooKeeper removed our ephemeral znodes, so another member may already hold our shards:
every shard is dropped at once without writing its offset, then the member registers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.recipe.watchers import ChildrenWatch

from casque.backends import zk
from casque.znodes import SubscriberPaths

log = logging.getLogger(__name__)

ShardCallback = Callable[[int], Awaitable[None]]


def assign(members: list[str], shards: list[int]) -> dict[str, set[int]]:
    """Which shards each member owns: round-robin over the sorted member ids."""
    ordered = sorted(members)
    owned: dict[str, set[int]] = {m: set() for m in ordered}
    if ordered:
        for index, shard in enumerate(sorted(shards)):
            owned[ordered[index % len(ordered)]].add(shard)
    return owned


class ShardLeases:
    def __init__(
        self,
        client: KazooClient,
        paths: SubscriberPaths,
        member_id: str,
        shards: list[int],
        on_acquired: ShardCallback,
        on_released: ShardCallback,
        on_lost: Callable[[], Awaitable[None]],
    ) -> None:
        self._client = client
        self._paths = paths
        self.member_id = member_id
        self.shards = shards
        self._on_acquired = on_acquired
        self._on_released = on_released
        self._on_lost = on_lost
        self.held: set[int] = set()
        self.connected = True
        self._members: list[str] = []
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lost = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._register()
        self._client.add_listener(self._on_state)
        active = lambda: not self._stopping  # noqa: E731
        ChildrenWatch(self._client, self._paths.members, zk.watch_in_loop(self._loop, self._members_changed, active))
        ChildrenWatch(self._client, self._paths.leases, zk.watch_in_loop(self._loop, self._leases_changed, active))
        self._task = self._loop.create_task(self._rebalance_loop())

    async def _register(self) -> None:
        try:
            await zk.call(self._client.create_async, self._paths.member(self.member_id), b"", ephemeral=True,
                          makepath=True)
        except NodeExistsError:
            pass

    def _members_changed(self, members: list[str], *_: object) -> None:
        self._members = list(members)
        self._wanted.set()

    def _leases_changed(self, *_: object) -> None:
        self._wanted.set()

    def _on_state(self, state: str) -> None:
        # Called on kazoo's thread: hand over to the loop.
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._state_changed, state)

    def _state_changed(self, state: str) -> None:
        if state == KazooState.LOST:
            self.connected = False
            self._lost = True
            self._wanted.set()
        elif state == KazooState.SUSPENDED:
            self.connected = False
        else:
            self.connected = True
            self._wanted.set()

    async def _rebalance_loop(self) -> None:
        while not self._stopping:
            await self._wanted.wait()
            self._wanted.clear()
            if self._stopping:
                return
            try:
                await self._rebalance()
            except Exception:
                log.exception("lease rebalance failed; retrying")
                await asyncio.sleep(0.5)
                self._wanted.set()

    async def _rebalance(self) -> None:
        if self._lost:
            # Our ephemeral znodes are gone: forget every shard without touching ZooKeeper.
            self._lost = False
            self.held.clear()
            await self._on_lost()
            if not self.connected and self._client.state != KazooState.CONNECTED:
                return
            await self._register()
            self._members = list(await zk.call(self._client.get_children_async, self._paths.members))
        if not self.connected:
            return
        mine = assign(self._members, self.shards).get(self.member_id, set())
        for shard in sorted(self.held - mine):
            await self._release(shard)
        for shard in sorted(mine - self.held):
            if await self._try_acquire(shard):
                self.held.add(shard)
                await self._on_acquired(shard)

    async def _try_acquire(self, shard: int) -> bool:
        path = self._paths.lease(shard)
        try:
            await zk.call(self._client.create_async, path, self.member_id.encode(), ephemeral=True)
            return True
        except NodeExistsError:
            try:
                data, stat = await zk.call(self._client.get_async, path)
            except NoNodeError:
                self._wanted.set()  # freed meanwhile: try again
                return False
            # A lease of ours from this very session (a create whose reply was lost).
            return bool(data.decode() == self.member_id and stat.ephemeralOwner == self._client.client_id[0])

    async def _release(self, shard: int) -> None:
        await self._on_released(shard)
        self.held.discard(shard)
        try:
            await zk.call(self._client.delete_async, self._paths.lease(shard))
        except NoNodeError:
            pass

    async def assigned(self) -> set[int]:
        """The shards this member should hold among the live members (held or not yet)."""
        members = await zk.call(self._client.get_children_async, self._paths.members)
        return assign(list(members), self.shards).get(self.member_id, set())

    async def stop(self) -> None:
        """Release every lease (after flushing each shard) and leave the group."""
        self._stopping = True
        self._wanted.set()
        if self._task is not None:
            await self._task
        for shard in sorted(self.held):
            await self._release(shard)
        self._client.remove_listener(self._on_state)
        try:
            await zk.call(self._client.delete_async, self._paths.member(self.member_id))
        except NoNodeError:
            pass
