"""Leader election through a Kubernetes Lease (coordination.k8s.io/v1): one active operator.

Every replica campaigns for the same Lease; only the holder runs kopf. What it guarantees:

- At most one replica believes it leads at any moment, provided clocks run at about the
  same *rate* (wall clocks need not agree). A candidate never compares the holder's
  `renewTime` with its own clock: it judges expiry by how long it has itself watched the
  Lease record stay unchanged, on its monotonic clock.
- Every write is a compare-and-set on the Lease's resourceVersion, so two candidates racing
  for an expired Lease cannot both win: the loser gets 409 Conflict.
- The holder gives up when it has not renewed for `renew_deadline`, which is shorter than
  the Lease duration, so it stops acting before any candidate may take over.

Losing the API server plays the part of ZooKeeper's SUSPENDED state: the holder carries on
while renewals fail, up to `renew_deadline`; then it is LOST, and the operator stops and
exits so that its pod restarts and campaigns afresh with clean memory. Even so, two replicas
could act at once for a moment if a process stalls for longer than the deadline without
noticing; that is tolerable because every reconcile action is idempotent and level-based.
A holder that stops cleanly releases the Lease, so a successor need not wait for it to expire.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum

from kubernetes import client
from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409


@dataclass(frozen=True)
class LeaseConfig:
    name: str
    namespace: str
    identity: str
    duration: float = 15.0  # how long a silent holder keeps the Lease
    renew_deadline: float = 10.0  # the holder stops leading after this long without a renewal
    retry_period: float = 2.0  # between attempts to acquire or renew

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.duration:
            raise ValueError("a Lease needs retry_period < renew_deadline < duration")


class Attempt(Enum):
    LEADING = "leading"  # acquired or renewed
    FOLLOWING = "following"  # someone else holds a Lease that has not expired
    FAILED = "failed"  # the API did not answer, or another candidate won a race


@dataclass(frozen=True)
class _Record:
    holder: str
    renew_time: object
    resource_version: str | None


class LeaderElector:
    def __init__(
        self,
        api: client.CoordinationV1Api,
        config: LeaseConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.config = config
        self.clock = clock
        self._observed: _Record | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None

    @property
    def leading(self) -> bool:
        return self._renewed_at is not None and self.clock() - self._renewed_at < self.config.renew_deadline

    def attempt(self) -> Attempt:
        """One try to acquire or renew the Lease (blocking; run it in a thread)."""
        now = datetime.now(timezone.utc)
        try:
            lease = self.api.read_namespaced_lease(self.config.name, self.config.namespace)
        except ApiException as error:
            if error.status == HTTP_NOT_FOUND:
                return self._create(now)
            logger.warning("reading Lease %s failed: %s", self.config.name, error.reason)
            return Attempt.FAILED
        except Exception as error:  # noqa: BLE001 - connection errors of every kind
            logger.warning("reading Lease %s failed: %s", self.config.name, error)
            return Attempt.FAILED
        spec = lease.spec or client.V1LeaseSpec()
        version = lease.metadata.resource_version if lease.metadata is not None else None
        record = _Record(spec.holder_identity or "", spec.renew_time, version)
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        duration = spec.lease_duration_seconds or self.config.duration
        held_by_other = record.holder not in ("", self.config.identity)
        if held_by_other and self.clock() - self._observed_at < duration:
            return Attempt.FOLLOWING
        if record.holder != self.config.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.config.identity
        spec.lease_duration_seconds = int(self.config.duration)
        spec.renew_time = now
        lease.spec = spec
        try:
            # The resourceVersion read above makes this a compare-and-set.
            self.api.replace_namespaced_lease(self.config.name, self.config.namespace, lease)
        except ApiException as error:
            if error.status != HTTP_CONFLICT:
                logger.warning("updating Lease %s failed: %s", self.config.name, error.reason)
            return Attempt.FAILED
        except Exception as error:  # noqa: BLE001
            logger.warning("updating Lease %s failed: %s", self.config.name, error)
            return Attempt.FAILED
        self._renewed_at = self.clock()
        return Attempt.LEADING

    def _create(self, now: datetime) -> Attempt:
        lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.config.name, namespace=self.config.namespace),
            spec=client.V1LeaseSpec(
                holder_identity=self.config.identity,
                lease_duration_seconds=int(self.config.duration),
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        try:
            self.api.create_namespaced_lease(self.config.namespace, lease)
        except Exception as error:  # noqa: BLE001 - 409: another candidate created it first
            logger.debug("creating Lease %s failed: %s", self.config.name, error)
            return Attempt.FAILED
        self._renewed_at = self.clock()
        return Attempt.LEADING

    async def acquire(self) -> None:
        """Return once this replica leads."""
        logger.info("campaigning for Lease %s/%s as %s", self.config.namespace, self.config.name, self.config.identity)
        while await asyncio.to_thread(self.attempt) is not Attempt.LEADING:
            await asyncio.sleep(self._jittered())
        logger.info("leading: holding Lease %s/%s", self.config.namespace, self.config.name)

    async def hold(self) -> None:
        """Renew until leadership is lost, then return. Cancel it to stop renewing."""
        while True:
            await asyncio.sleep(self.config.retry_period)
            result = await asyncio.to_thread(self.attempt)
            if result is Attempt.FOLLOWING:
                logger.error("Lease %s was taken over by another replica", self.config.name)
                return
            if not self.leading:
                logger.error("could not renew Lease %s for %.0fs", self.config.name, self.config.renew_deadline)
                return

    def release(self) -> None:
        """Hand the Lease back so that a successor need not wait for it to expire (blocking)."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        try:
            lease = self.api.read_namespaced_lease(self.config.name, self.config.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.config.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = datetime.now(timezone.utc)
            self.api.replace_namespaced_lease(self.config.name, self.config.namespace, lease)
        except Exception as error:  # noqa: BLE001 - it will expire anyway
            logger.warning("releasing Lease %s failed: %s", self.config.name, error)

    def _jittered(self) -> float:
        # Spread candidates' attempts so that they do not collide in lock step.
        return self.config.retry_period * random.uniform(1.0, 1.2)
