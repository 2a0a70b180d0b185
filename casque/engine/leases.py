"""Shard leases: the live consumers of a subscriber share its shards evenly and stickily.

Recipe:
- Each consumer registers an ephemeral member znode. Every member computes the same
  assignment from the same member list (`assign`: rendezvous hashing with a bound on each
  member's load), so no coordinator is needed, the shares differ by at most one shard, and
  a member joining or leaving moves about shards/members shards on average (the load bound
  can knock one move on to another: at most about twice that), not most of them.
- A member consumes a shard only while it holds the shard's ephemeral lease znode (data: its
  member id). It creates the lease and bumps the shard's fence znode in one multi, so the
  fence version names the acquisition: offset commits and the lease's own release check it,
  and a member that lost the lease without noticing (a pause past its session) can neither
  move the offset nor delete the next holder's lease.
- On a membership change a member first releases the shards it no longer owns (after its
  callback has flushed acks and offsets), then tries to create the leases of its new
  shards; a lease still held by the previous owner is retried when the lease children
  change. A shard whose acquisition callback fails is released and retried with backoff.

Trust: a member hands out messages only while its session is known to be alive
(casque.engine.session_trust: heartbeats, and the window they confirm).

Proof of a lease without asking: the fence of a shard moves only when a member creates the
shard's lease znode (the same multi), and that create fails while our lease exists. Our
lease is ephemeral: it exists while the session that created it lives, until we delete it
(the release, after our reader stopped) or the subscriber's deletion removes the tree. So
`surely_held` answers "our acquisition is still the shard's latest" locally when the shard
is held under that acquisition, not being released, and the session that created the lease
is the one the last answered heartbeat confirmed, within the trust window. An ack
written as a row needs exactly that after its write (the next holder reads the rows only
after it acquires); outside the window, or in doubt, the caller asks ZooKeeper instead.

Connection states: SUSPENDED keeps the leases (the session may still be alive) but the
consumer stops handing out messages until CONNECTED again. LOST means the session expired
and ZooKeeper removed our ephemeral znodes, so another member may already hold our shards:
every shard is dropped at once without writing its offset; once connected again (a new
session) the member registers again and takes its share back.

Stepping back (`step_back`, a member that cannot reach Cassandra: casque.engine.reachability):
the member deletes its member znode, so every other member's assignment leaves it out and
they take its shards as they free up, and hands every shard over as a rebalance does; it
registers again on `rejoin`. Its session lives on meanwhile, so its leases stay fenced.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError
from kazoo.recipe.watchers import ChildrenWatch

from casque.backends import zk
from casque.engine.protocol import SPEAKS
from casque.engine.session_trust import SessionTrust, session_of
from casque.errors import BackendUnavailable
from casque.backends.loop_handoff import call_soon_unless_closed
from casque.znodes import SubscriberPaths

log = logging.getLogger(__name__)

# Acquisition and release callbacks get the shard and the fence version of the acquisition.
AcquisitionCallback = Callable[[int, int], Awaitable[None]]
RETRY_MIN_SECONDS = 0.2
RETRY_MAX_SECONDS = 5.0

# What a member's znode says from its creation on, before its first counters: the protocol
# its sidecar speaks, which a raise of the installation's checks (casque.engine.protocol).
MEMBER_DATA = SPEAKS


def _score(member: str, shard: int) -> int:
    digest = hashlib.blake2b(f"{member}/{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def assign(members: list[str], shards: list[int]) -> dict[str, set[int]]:
    """Which shards each member owns.

    Every (member, shard) pair gets a hash score; pairs are taken best score first, and a
    shard goes to the first member of its pairs with room. Room: at most floor(S/N) shards
    each, plus one for the first S mod N members to reach that. The loads come out even
    (within one), and since a shard's preferences do not depend on other members, a member
    joining takes shards from the others instead of reshuffling them.
    """
    ordered = sorted(set(members))
    owned: dict[str, set[int]] = {m: set() for m in ordered}
    if not ordered:
        return owned
    base, extra = divmod(len(shards), len(ordered))
    pairs = sorted(((_score(m, s), m, s) for m in ordered for s in set(shards)), reverse=True)
    owner: dict[int, str] = {}
    for _, member, shard in pairs:
        if shard in owner:
            continue
        load = len(owned[member])
        if load < base or (load == base and extra > 0):
            if load == base:
                extra -= 1
            owner[shard] = member
            owned[member].add(shard)
    return owned


class ShardLeases:
    def __init__(
        self,
        client: KazooClient,
        paths: SubscriberPaths,
        member_id: str,
        shards: list[int],
        on_acquired: AcquisitionCallback,
        on_released: AcquisitionCallback,
        on_lost: Callable[[], Awaitable[None]],
        on_trusted: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._paths = paths
        self.member_id = member_id
        self.shards = list(shards)
        self._on_acquired = on_acquired
        self._on_released = on_released
        self._on_lost = on_lost
        # Held shards and the fence version of our acquisition.
        self.held: dict[int, int] = {}
        self.connected = True
        self.registered = False
        # How many times our member znode was created: a claim written before the latest
        # registration may have been taken over while the znode was gone (see `vouches`).
        self.registrations = 0
        # Out of the group on purpose (step_back) until rejoin.
        self.stepped_back = False
        self._members: list[str] = []
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lost = False
        self._retry_delay = RETRY_MIN_SECONDS
        # Shards being handed over to other members, each by a task of its own.
        self._handing_over: dict[int, asyncio.Task[None]] = {}
        self._fences_known: set[int] = set()
        # Acquisitions (shard, fence) being handed over and released.
        self._releasing: set[tuple[int, int]] = set()
        self.last_error = ""
        self._start_failures: list[str] = []
        self.trust = SessionTrust(client, paths.member(member_id), lambda: self.connected, on_trusted)
        # The session in which each held shard's lease znode was created (None: not known).
        self._sessions: dict[int, int | None] = {}
    @property
    def session_seconds(self) -> float:
        """The session timeout the server granted at the last connect."""
        return self.trust.session_seconds

    @property
    def members(self) -> list[str]:
        """The group's members, as the last membership watch reported them."""
        return list(self._members)

    @property
    def trusted(self) -> bool:
        """Whether our session, and with it every lease we hold, is known to be alive now."""
        return self.trust.trusted

    def vouches(self, registration: int) -> bool:
        """Whether a claim of shared delivery written during `registration` cannot have been
        taken over as a departed member's (casque.engine.sharing): our member znode has existed
        since, and our session is known to be alive for half a session more."""
        return (self.registered and not self.stepped_back and registration == self.registrations
                and self.trusted)

    @property
    def session_id(self) -> int:
        """Our ZooKeeper session's id now (0 when there is none)."""
        return session_of(self._client) or 0

    def surely_held(self, shard: int, fence: int) -> bool:
        """Whether our lease on `shard`, acquired with `fence`, provably still exists on the
        server now, so the fence is still ours (see "Proof of a lease" above). False means
        "not known", not "lost": the caller then asks ZooKeeper."""
        session = self._sessions.get(shard)
        return (
            self.held.get(shard) == fence
            and (shard, fence) not in self._releasing
            and not self._lost
            and self.connected
            and self.trust.confirms(session)
        )

    def _current_session(self) -> int:
        session = session_of(self._client)
        if session is None:
            raise BackendUnavailable("ZooKeeper: not connected")
        return session

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._register()
        self._client.add_listener(self._on_state)
        active = lambda: not self._stopping  # noqa: E731
        ChildrenWatch(self._client, self._paths.members, zk.watch_in_loop(self._loop, self._members_changed, active))
        if self.shards:
            # Not in shared delivery (no shards to lease): there every claim checks the leases
            # directory with a create and delete (casque.engine.claims), which would wake us.
            ChildrenWatch(self._client, self._paths.leases, zk.watch_in_loop(self._loop, self._leases_changed, active))
        self._task = self._loop.create_task(self._rebalance_loop())
        self.trust.start()

    async def _register(self) -> None:
        path = self._paths.member(self.member_id)
        try:
            # Never makepath: that would bring back a subscriber deleted meanwhile, empty.
            await zk.call(self._client.create_async, path, MEMBER_DATA, ephemeral=True)
        except NodeExistsError:
            # Ours from this session (a create whose reply was lost), or a leftover of an
            # expired session that the server has not removed yet: replace the latter.
            _, stat = await zk.call(self._client.get_async, path)
            if stat.ephemeralOwner != self._current_session():
                await zk.call(self._client.delete_async, path, stat.version)
                await zk.call(self._client.create_async, path, MEMBER_DATA, ephemeral=True)
        self.registrations += 1
        self.registered = True

    def step_back(self) -> None:
        """Leave the group and hand every shard over, staying connected (see "Stepping back")."""
        if not self.stepped_back:
            self.stepped_back = True
            self._wanted.set()

    def rejoin(self) -> None:
        if self.stepped_back:
            self.stepped_back = False
            self._wanted.set()

    async def _leave(self) -> None:
        """Delete our member znode (of this session only: one left by an expired session goes by itself)."""
        path = self._paths.member(self.member_id)
        try:
            _, stat = await zk.call(self._client.get_async, path)
            if stat.ephemeralOwner == self._current_session():
                await zk.call(self._client.delete_async, path, stat.version)
        except NoNodeError:
            pass
        self.registered = False

    def set_shards(self, shards: list[int]) -> None:
        """The queue's shards changed (shards or priority levels added): rebalance over the new set."""
        if sorted(shards) != sorted(self.shards):
            self.shards = list(shards)
            self._wanted.set()

    def forget(self, shard: int) -> None:
        """The shard's fence moved under us: someone else holds it. Drop it without touching ZooKeeper."""
        self._sessions.pop(shard, None)
        if self.held.pop(shard, None) is not None:
            self._wanted.set()

    def _members_changed(self, members: list[str], *_: object) -> None:
        self._members = list(members)
        self._wanted.set()

    def _leases_changed(self, *_: object) -> None:
        self._wanted.set()

    def _on_state(self, state: str) -> None:
        # Called on kazoo's thread: hand over to the loop.
        if self._loop is None:
            return
        call_soon_unless_closed(self._loop, self._state_changed, state)

    def _state_changed(self, state: str) -> None:
        if state == KazooState.LOST:
            self.connected = False
            self.registered = False
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
            self._start_failures = []
            try:
                retry = await self._rebalance()
                # A shard whose reader failed to start (a record it cannot read, say) is the
                # member's problem until it starts: readiness names it.
                self.last_error = "; ".join(self._start_failures)
            except Exception as error:  # every failure is retried: a member must never stop rebalancing
                self.last_error = f"{type(error).__name__}: {error}"
                log.warning("lease rebalance failed (%s); retrying in %.1fs", self.last_error, self._retry_delay)
                retry = True
            if retry:
                await asyncio.sleep(self._retry_delay)
                self._retry_delay = min(self._retry_delay * 2, RETRY_MAX_SECONDS)
                self._wanted.set()
            else:
                self._retry_delay = RETRY_MIN_SECONDS

    async def _rebalance(self) -> bool:
        """One pass; True if something must be tried again later."""
        if self._lost:
            # Our ephemeral znodes are gone: forget every shard without touching ZooKeeper.
            self._lost = False
            self.held.clear()
            self._sessions.clear()
            await self._on_lost()
        if not self.connected or self._client.state != KazooState.CONNECTED:
            return False  # the CONNECTED transition sets _wanted again
        if self.stepped_back:
            if self.registered:
                await self._leave()
            mine: set[int] = set()
        else:
            if not self.registered:
                await self._register()
                self._members = list(await zk.call(self._client.get_children_async, self._paths.members))
            mine = assign(self._members, self.shards).get(self.member_id, set())
        # Shards moving away are handed over each in a task of its own: a hand-over waits
        # for the deliveries in flight (up to their visibility), and meanwhile this member
        # takes its new shards and follows further membership changes. A hand-over ends one
        # acquisition: if the session is lost meanwhile and the shard taken again, the new
        # acquisition is not the hand-over's to end.
        for shard in sorted(set(self.held) - mine):
            if shard not in self._handing_over:
                hand_over = self._hand_over(shard, self.held[shard])
                self._handing_over[shard] = asyncio.get_running_loop().create_task(hand_over)
        retry = False
        for shard in sorted(mine - set(self.held)):
            fence = await self._try_acquire(shard)
            if fence is None:
                continue
            self.held[shard] = fence
            try:
                await self._on_acquired(shard, fence)
            except Exception as error:
                # Without a reader the lease would strand the shard: give it up and try again.
                log.warning("shard %s: starting to consume failed (%s); releasing and retrying", shard, error)
                self._start_failures.append(f"shard {shard}: {type(error).__name__}: {error}")
                self.held.pop(shard, None)
                await self._delete_lease(shard, fence)
                retry = True
        return retry

    async def _ensure_fence(self, shard: int) -> None:
        if shard in self._fences_known:
            return
        # Subscribers created before fences existed lack the fences znode: create it, but only
        # while the subscriber exists (the check fails the whole multi otherwise).
        transaction = self._client.transaction()
        transaction.check(self._paths.base, -1)
        transaction.create(self._paths.fence(shard), b"")
        results = await zk.call(transaction.commit_async)
        cause = next((r for r in results if isinstance(r, Exception) and not isinstance(r, RolledBackError)), None)
        if isinstance(cause, NoNodeError):
            try:
                await zk.call(self._client.create_async, self._paths.fences, b"")
            except (NodeExistsError, NoNodeError):
                pass  # there already, or the subscriber is gone
            raise BackendUnavailable(f"shard {shard}: no fence yet (the subscriber is being created or deleted)")
        if cause is not None and not isinstance(cause, NodeExistsError):
            raise cause
        self._fences_known.add(shard)

    async def _try_acquire(self, shard: int) -> int | None:
        """Create the lease and bump the fence in one multi; the new fence version, or None if held."""
        await self._ensure_fence(shard)
        transaction = self._client.transaction()
        transaction.create(self._paths.lease(shard), self.member_id.encode(), ephemeral=True)
        transaction.set_data(self._paths.fence(shard), self.member_id.encode())
        before = session_of(self._client)
        results = await zk.call(transaction.commit_async)
        created, fence = results
        if not isinstance(created, Exception) and not isinstance(fence, Exception):
            # The multi ran in the session current when it was sent and answered; if the
            # client changed sessions meanwhile, which one is not known (never proven held).
            after = session_of(self._client)
            self._sessions[shard] = before if before == after else None
            return int(fence.version)
        cause = next(r for r in results if isinstance(r, Exception) and not isinstance(r, RolledBackError))
        if isinstance(cause, NoNodeError):
            self._fences_known.discard(shard)
            raise BackendUnavailable(f"shard {shard}: the fence or lease parent is missing")
        if not isinstance(cause, NodeExistsError):
            raise cause
        try:
            data, stat = await zk.call(self._client.get_async, self._paths.lease(shard))
        except NoNodeError:
            self._wanted.set()  # freed meanwhile: try again
            return None
        if data.decode() == self.member_id and stat.ephemeralOwner == self._current_session():
            # Our own multi whose reply was lost: nobody can have bumped the fence since.
            _, fence_stat = await zk.call(self._client.get_async, self._paths.fence(shard))
            self._sessions[shard] = int(stat.ephemeralOwner)
            return int(fence_stat.version)
        return None

    async def _hand_over(self, shard: int, fence: int) -> None:
        try:
            await self._release(shard, fence)
        except Exception as error:  # the lease stays ours: the next pass hands the shard over again
            log.warning("shard %s: handing over failed (%s); trying again", shard, error)
            await asyncio.sleep(self._retry_delay)
        finally:
            self._handing_over.pop(shard, None)
            self._wanted.set()

    async def _release(self, shard: int, fence: int) -> None:
        """Hand the acquisition `fence` of `shard` over, then delete its lease. If the session
        was lost meanwhile, the lease went with it and the shard may be held again, under a
        new fence: that acquisition, its reader and its lease are left alone."""
        # From the hand-over on, an ack of this shard asks ZooKeeper: the lease is about to go.
        acquisition = (shard, fence)
        self._releasing.add(acquisition)
        try:
            await self._on_released(shard, fence)
        finally:
            self._releasing.discard(acquisition)
        if self.held.get(shard) != fence:
            return
        await self._delete_lease(shard, fence)
        if self.held.get(shard) == fence:
            del self.held[shard]
            self._sessions.pop(shard, None)

    async def _delete_lease(self, shard: int, fence: int) -> None:
        """Delete our lease, unless the fence moved: then the lease there is someone else's."""
        transaction = self._client.transaction()
        transaction.check(self._paths.fence(shard), fence)
        transaction.delete(self._paths.lease(shard))
        results = await zk.call(transaction.commit_async)
        failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if failures and not isinstance(failures[0], (BadVersionError, NoNodeError)):
            raise failures[0]

    async def assigned(self) -> set[int] | None:
        """The shards this member should hold among the live members (held or not yet);
        None while this member is not in the group."""
        members = await zk.call(self._client.get_children_async, self._paths.members)
        if self.member_id not in members:
            return None
        return assign(list(members), self.shards).get(self.member_id, set())

    async def stop(self) -> None:
        """Release every lease (after flushing each shard) and leave the group."""
        self._stopping = True
        self._wanted.set()
        await self.trust.stop()
        if self._task is not None:
            await self._task
        if self._handing_over:
            await asyncio.gather(*self._handing_over.values(), return_exceptions=True)
        for shard, fence in sorted(self.held.items()):
            try:
                await self._release(shard, fence)
            except BackendUnavailable as error:
                log.warning("shard %s: lease not released (%s); it goes when the session ends", shard, error)
        self._client.remove_listener(self._on_state)
        try:
            await zk.call(self._client.delete_async, self._paths.member(self.member_id))
        except (NoNodeError, BackendUnavailable):
            pass
