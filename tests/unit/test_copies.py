"""The copies of the sidecar's Secrets, pure: which Secrets, what a copy holds, and when the
operator writes one (never over a Secret it does not manage)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import SecretStr

from casque.config import CassandraTlsSettings, Settings, ZooKeeperTlsSettings
from casque.operator.copies import (
    SOURCE_ANNOTATION,
    WebhookCopier,
    decide,
    is_managed,
    source_names,
    update_patch,
    wanted_copy,
)
from casque.operator.injection import InjectionSettings

MANAGED = {"app.kubernetes.io/managed-by": "casque-operator"}


def source(name: str = "casque-cassandra", data: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "casque-system", "resourceVersion": "7",
                         "labels": {"app.kubernetes.io/managed-by": "Helm"}},
            "type": "kubernetes.io/tls", "data": data if data is not None else {"username": "dQ==", "password": "cA=="},
            **extra}


def test_the_sources_are_the_secrets_a_sidecar_reads() -> None:
    injection = InjectionSettings(credentials_secret="creds", cassandra_tls_secret="cass-tls",
                                  zookeeper_tls_secret="zk-tls")
    assert source_names(injection, Settings()) == ["creds"]
    tls = Settings(cassandra_tls=CassandraTlsSettings(enabled=True), zookeeper_tls=ZooKeeperTlsSettings(enabled=True))
    assert source_names(injection, tls) == ["creds", "cass-tls", "zk-tls"]
    # With keyspace isolation the sidecar reads its namespace's own role: no shared credentials.
    isolated = Settings(cassandra_isolation="keyspace", cassandra_username="casque",
                        cassandra_password=SecretStr("p" * 16), derivation_key=SecretStr("k" * 40))
    assert source_names(injection, isolated) == []
    assert source_names(InjectionSettings(), tls) == []
    # One Secret for both backends is copied once.
    shared = InjectionSettings(cassandra_tls_secret="tls", zookeeper_tls_secret="tls")
    assert source_names(shared, tls) == ["tls"]


def test_a_copy_is_opaque_labelled_and_names_its_source() -> None:
    copy = wanted_copy(source(), "shop")
    assert copy["type"] == "Opaque"  # the chart's admission policy lets the operator write nothing else
    assert copy["metadata"] == {"name": "casque-cassandra", "namespace": "shop", "labels": MANAGED,
                                "annotations": {SOURCE_ANNOTATION: "casque-system/casque-cassandra"}}
    assert copy["data"] == source()["data"]
    assert is_managed(copy) and not is_managed(source())


def test_a_missing_copy_is_created_a_stale_one_updated_a_current_one_left() -> None:
    wanted = wanted_copy(source(), "shop")
    assert decide(None, wanted) == "create"
    assert decide(wanted, wanted) == "unchanged"
    rotated = wanted_copy(source(data={"username": "dQ==", "password": "bmV3"}), "shop")
    assert decide(wanted, rotated) == "update"


def test_a_secret_of_the_same_name_without_the_label_is_never_written() -> None:
    wanted = wanted_copy(source(), "shop")
    users = {"metadata": {"name": "casque-cassandra", "namespace": "shop"}, "data": {"username": "eA=="}}
    assert decide(users, wanted) == "unmanaged"
    # Not even when it holds the very same data, nor with another tool's managed-by label.
    assert decide({**users, "data": wanted["data"]}, wanted) == "unmanaged"
    helm = {**users, "metadata": {**users["metadata"], "labels": {"app.kubernetes.io/managed-by": "Helm"}}}
    assert decide(helm, wanted) == "unmanaged"


def test_an_update_removes_the_keys_the_source_dropped() -> None:
    old = wanted_copy(source(data={"ca.crt": "YQ==", "tls.crt": "Yg==", "tls.key": "Yw=="}), "shop")
    new = wanted_copy(source(data={"ca.crt": "ZA=="}), "shop")
    assert update_patch(old, new) == {
        "metadata": {"annotations": {SOURCE_ANNOTATION: "casque-system/casque-cassandra"}},
        "data": {"ca.crt": "ZA==", "tls.crt": None, "tls.key": None},
    }


def test_the_webhook_copies_once_per_namespace_at_a_time_and_never_into_the_source_namespace() -> None:
    calls: list[str] = []

    class Counting(WebhookCopier):
        def copy(self, namespace: str) -> Any:
            calls.append(namespace)
            from casque.operator.copies import CopyReport

            return CopyReport(namespace)

    async def main() -> None:
        copier = Counting(lambda: pytest.fail("no API client needed"), "casque-system", ["casque-cassandra"], {})
        for _ in range(5):  # a burst of pods in one namespace
            copier.schedule("shop")
        copier.schedule("casque-system")
        await copier.wait()
        copier.schedule("shop")  # a later pod: a new pass
        await copier.wait()
        idle = Counting(lambda: pytest.fail("no API client needed"), "casque-system", [], {})
        idle.schedule("shop")  # nothing to copy
        await idle.wait()

    asyncio.run(main())
    assert calls == ["shop", "shop"]


def test_a_queues_reconcile_reports_a_problem_and_its_timer_only_when_the_problem_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import logging

    import kopf

    from casque.operator.context import OperatorContext, OperatorOptions, StoreHolder
    from casque.operator.copies import CopyReport
    from casque.operator.handlers import secrets

    warned: list[str] = []
    passes: list[str] = []
    unmanaged = ["casque-cassandra"]

    def copy_all(context: OperatorContext, sources: list[str], namespace: str) -> CopyReport:
        passes.append(namespace)
        return CopyReport(namespace, unmanaged=list(unmanaged))

    monkeypatch.setattr(secrets, "copy_all", copy_all)
    monkeypatch.setattr(kopf, "warn", lambda body, *, reason, message: warned.append(reason))
    context = OperatorContext(stores=StoreHolder(Settings()), options=OperatorOptions(refresh_interval=30),
                              injection=InjectionSettings(credentials_secret="casque-cassandra"),
                              secrets_namespace="casque-system")
    body = kopf.Body({"metadata": {"name": "orders", "namespace": "shop"}})
    logger = logging.getLogger("test")

    async def tick() -> None:
        context.copies_checked.clear()  # as if the refresh interval had passed
        await secrets.keep_copies(context, body, logger, timer=True)

    async def main() -> None:
        await secrets.keep_copies(context, body, logger)  # a reconcile: always said
        await secrets.keep_copies(context, body, logger, timer=True)  # a tick right after: skipped
        assert passes == ["shop"]
        await tick()  # the same problem: not said again
        unmanaged.clear()
        await tick()  # solved
        unmanaged.append("casque-cassandra")
        await tick()  # back: said again

    asyncio.run(main())
    assert len(passes) == 4 and warned == ["SecretNotCopied", "SecretNotCopied"]

    # Without the operator's own namespace there is nowhere to copy from.
    passes.clear()
    context.secrets_namespace = None
    asyncio.run(secrets.keep_copies(context, body, logger))
    assert passes == []
