"""A sidecar's presence among a queue's publishers, saying which protocol it speaks.

Members of a subscriber group say their protocol in their member znode; a sidecar that only
publishes joins no group, yet a raise of the installation's protocol must not leave it
writing records its peers would misread. So every sidecar puts an ephemeral znode in the
`publishers` container of each queue it publishes to (casque.znodes), holding what a
member's holds (`{"protocol": N}`), and casque.engine.protocol_change reads both.

An ephemeral znode ends with its session: after a session is lost the presence is made
again in the next one. A queue made before the installation made the container has none
until its next apply; meanwhile the sidecar is not seen there and says so in its log. A
presence that cannot be made never fails a publish.
"""

from __future__ import annotations

import asyncio
import logging

from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.protocol.states import KazooState

from casque.backends import zk
from casque.engine.protocol import SPEAKS
from casque.engine.session_trust import session_of
from casque.errors import BackendUnavailable
from casque.schema import QueueRef
from casque.backends.loop_handoff import call_soon_unless_closed
from casque.store import Store

log = logging.getLogger(__name__)


class Presence:
    """This sidecar's presence (as `name`) among the publishers of every queue it published to."""

    def __init__(self, store: Store, name: str) -> None:
        self._store = store
        self.name = name
        self._queues: set[QueueRef] = set()
        self._loop = asyncio.get_running_loop()
        self._lost = False
        # The remakes under way: the loop keeps only a weak reference to a task.
        self._remaking: set[asyncio.Task[None]] = set()
        store.zk.add_listener(self._on_state)

    async def announce(self, queue: QueueRef) -> None:
        """Be present among `queue`'s publishers (once; again after a lost session)."""
        if queue not in self._queues:
            self._queues.add(queue)
            await self._make(queue)

    async def _make(self, queue: QueueRef) -> None:
        path = self._store.paths(queue).publisher(self.name)
        client = self._store.zk
        try:
            try:
                await zk.call(client.create_async, path, SPEAKS, ephemeral=True)
            except NodeExistsError:
                # Ours from this session (a create whose reply was lost), or from the session
                # that was lost, which the server has not ended yet: replaced, or it would go with it.
                _, stat = await zk.call(client.get_async, path)
                if stat.ephemeralOwner != session_of(client):
                    await zk.call(client.delete_async, path, stat.version)
                    await zk.call(client.create_async, path, SPEAKS, ephemeral=True)
        except NoNodeError:
            log.info("queue %s has no publishers container yet (its next apply makes it): a raise of the "
                     "protocol does not see this sidecar there", queue)
        except (KazooException, BackendUnavailable, OSError) as error:
            log.warning("presence among the publishers of %s not made: %s", queue, error)

    def _on_state(self, state: str) -> bool:
        # Runs on kazoo's thread: the presences are made again on the event loop.
        if state == KazooState.LOST:
            self._lost = True
        elif state == KazooState.CONNECTED and self._lost:
            self._lost = False
            call_soon_unless_closed(self._loop, self._remake)
        return False

    def _remake(self) -> None:
        for queue in sorted(self._queues):
            task = self._loop.create_task(self._make(queue))
            self._remaking.add(task)
            task.add_done_callback(self._remaking.discard)
