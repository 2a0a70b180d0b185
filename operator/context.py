"""What the handlers share within one operator process: backends, per-object locks, watch health.

kopf hands every handler a `memo`; the operator keeps one `OperatorContext` in it as
`memo.casque`. Handler state stays in this process and in the objects' status: nothing
large is kept in annotations.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from casque.config import Settings
from casque.operator import kube, namespace_setup
from casque.operator.failures import QUOTA_RETRY_SECONDS
from casque.operator.health import DEFAULT_STALL_AFTER, WatchHealth
from casque.operator.injection import InjectionSettings
from casque.operator.quotas import QuotaSettings
from casque.operator.refusals import QuotaRefusals
from casque.operator.storage_quota import NamespaceStorage
from casque.store import Store


class OperatorOptions(BaseSettings):
    """Tuning of the operator itself, from CASQUE_OPERATOR_* environment variables."""

    model_config = SettingsConfigDict(env_prefix="CASQUE_OPERATOR_")

    # How often each Queue's and Subscriber's figures are re-read (and drift repaired).
    refresh_interval: float = Field(default=30.0, gt=0)
    # How long the watch may lag behind a LIST before the liveness probe fails.
    watch_stall_seconds: float = Field(default=DEFAULT_STALL_AFTER, gt=0)
    # How long a Queue refused for its namespace's quotas waits before it is tried again,
    # when neither its Namespace's quota annotations change nor a Queue beside it goes.
    quota_retry_seconds: float = Field(default=QUOTA_RETRY_SECONDS, gt=0)


class StoreHolder:
    """Opens the Store on first use and keeps it; a failed open is retried on the next use.

    The operator therefore starts, and reports BackendUnavailable in conditions, while
    Cassandra or ZooKeeper is down. Called from worker threads, hence the lock.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._store: Store | None = None
        self._lock = threading.Lock()

    @property
    def settings(self) -> Settings:
        return self._settings

    def __call__(self) -> Store:
        with self._lock:
            if self._store is None:
                self._store = namespace_setup.open_store(self._settings)
            return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


@dataclass
class OperatorContext:
    stores: StoreHolder
    options: OperatorOptions = field(default_factory=OperatorOptions)
    quotas: QuotaSettings = field(default_factory=QuotaSettings)
    # Each namespace's stored bytes against its quota, and the writes its role was given.
    storage: NamespaceStorage = field(default_factory=lambda: NamespaceStorage(OperatorOptions().refresh_interval))
    health: WatchHealth = field(default_factory=WatchHealth)
    # Queues refused for their namespace's quotas, tried again when room may have been made.
    refusals: QuotaRefusals = field(default_factory=QuotaRefusals)
    # Namespaces the operator serves; empty means all of them.
    namespaces: tuple[str, ...] = ()
    # The sidecar the webhook injects, whose Secrets the operator copies (casque.operator.copies).
    injection: InjectionSettings = field(default_factory=InjectionSettings)
    # The operator's own namespace, where the Secrets copied into app namespaces are read;
    # None (run outside a pod without POD_NAMESPACE): no copies.
    secrets_namespace: str | None = None
    # Per namespace: when its copies were last checked (monotonic), and the problems last reported.
    copies_checked: dict[str, float] = field(default_factory=dict)
    copies_reported: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The operator's own background tasks (casque.operator.handlers.secrets), ended by `stopped`.
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Set to stop kopf (leadership lost), and by the cleanup activity however kopf stops: kopf
    # waits for a task watching its stop flag, so a flag left unset would hold up its exit.
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _kube: client.ApiClient | None = None
    _kube_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_environment(cls, namespaces: tuple[str, ...] = ()) -> OperatorContext:
        options = OperatorOptions()
        return cls(
            stores=StoreHolder(Settings()),
            options=options,
            quotas=QuotaSettings(),
            storage=NamespaceStorage(options.refresh_interval),
            health=WatchHealth(stall_after=options.watch_stall_seconds),
            namespaces=namespaces,
            injection=InjectionSettings(),
            secrets_namespace=os.environ.get("POD_NAMESPACE") or None,
        )

    def lock(self, uid: str) -> asyncio.Lock:
        """One object's change handlers and its status timer run one at a time.

        kopf serialises an object's change handlers, but runs its timer as a separate task.
        """
        return self._locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        self._locks.pop(uid, None)

    def kube_api(self) -> client.ApiClient:
        """A client of the Kubernetes API (the probe's LISTs, namespaces' Secrets and
        quota annotations), made on first use."""
        with self._kube_lock:
            if self._kube is None:
                self._kube = kube.api_client()
            return self._kube

    def close(self) -> None:
        self.stopped.set()
        self.stores.close()
        with self._kube_lock:
            if self._kube is not None:
                self._kube.close()  # type: ignore[no-untyped-call]
                self._kube = None


def context_of(memo: Any) -> OperatorContext:
    context = getattr(memo, "casque", None)
    if not isinstance(context, OperatorContext):
        raise RuntimeError("the operator's context is missing from kopf's memo; start it with `casque operator run`")
    return context
