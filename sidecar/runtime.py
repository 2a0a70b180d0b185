"""What the sidecar has connected so far.

The sidecar listens before its backends answer: Cassandra or ZooKeeper down when the pod
starts must not make it exit and crash-loop (a crash-looping sidecar also keeps the app
container from starting). Until the backends are connected `service` is None, API calls
get 503 `not_ready` with Retry-After, /healthz answers (the process is alive) and /readyz
says what is missing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from casque.sidecar.errors import NotReady
from casque.sidecar.service import QueueService
from casque.store import Store


@dataclass
class Runtime:
    store: Store | None = None
    service: QueueService | None = None
    problem: str = "connecting to Cassandra and ZooKeeper"
    # Set once `service` is.
    connected: asyncio.Event = field(default_factory=asyncio.Event)

    def require(self) -> QueueService:
        if self.service is None:
            raise NotReady(f"the sidecar is starting: {self.problem}")
        return self.service
