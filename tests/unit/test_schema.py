import pytest

from casque.errors import InvalidSpec
from casque.schema import (
    BATCHES_PER_BUCKET,
    QueueRef,
    alter_retention_ddl,
    bucket_of,
    messages_table_ddl,
    twcs_window,
    validate_name,
)
from casque.sidecar.config import SidecarSettings


@pytest.mark.parametrize(
    ("retention", "window"),
    [
        (3600, ("MINUTES", 3)),
        (86400, ("HOURS", 1)),
        (7 * 86400, ("HOURS", 7)),
        (30 * 86400, ("DAYS", 2)),
        (365 * 86400, ("DAYS", 16)),
    ],
)
def test_twcs_window_gives_about_24_windows(retention: int, window: tuple[str, int]) -> None:
    assert twcs_window(retention) == window
    unit, size = window
    seconds = {"MINUTES": 60, "HOURS": 3600, "DAYS": 86400}[unit] * size
    assert 12 <= retention / seconds <= 24


def test_retention_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidSpec, match="retention"):
        twcs_window(10)


def test_table_names_are_valid_distinct_and_stable() -> None:
    a = QueueRef("team-a", "orders")
    b = QueueRef("team-b", "orders")
    long = QueueRef("default", "x" * 63)
    assert a.messages_table != b.messages_table
    assert a.messages_table == QueueRef("team-a", "orders").messages_table
    for ref in (a, b, long):
        assert len(ref.messages_table) <= 48
        assert ref.messages_table.replace("_", "").isalnum()


@pytest.mark.parametrize("bad", ["Orders", "a_b", "-a", "a" * 64, ""])
def test_queue_names_must_be_dns_labels(bad: str) -> None:
    with pytest.raises(InvalidSpec):
        QueueRef("default", bad)


@pytest.mark.parametrize("kind", ["queue", "subscriber", "namespace"])
def test_a_name_is_matched_whole_so_a_trailing_newline_is_refused(kind: str) -> None:
    # Python's `$` also matches before a final newline: `re.match` with it took "orders\n".
    with pytest.raises(InvalidSpec, match="DNS label"):
        validate_name(kind, "orders\n")
    with pytest.raises(InvalidSpec):
        QueueRef("default\n", "orders") if kind == "namespace" else QueueRef("default", "orders\n")
    assert validate_name(kind, "orders") == "orders"


def test_the_sidecars_settings_refuse_names_with_a_trailing_newline() -> None:
    with pytest.raises(ValueError, match="DNS label"):
        SidecarSettings(queue="orders", subscribers=["billing\n"])
    with pytest.raises(ValueError, match="DNS label"):
        SidecarSettings(publish_scope=["orders\n"])
    with pytest.raises(ValueError, match="queue/subscriber"):
        SidecarSettings(subscribe_scope=["orders/billing\n"])


def test_parse_defaults_namespace() -> None:
    assert QueueRef.parse("orders") == QueueRef("default", "orders")
    assert QueueRef.parse("shop/orders") == QueueRef("shop", "orders")


def test_messages_table_is_ttl_twcs_and_partitioned_by_shard_and_bucket() -> None:
    ddl = messages_table_ddl("ks", QueueRef("default", "orders"), 86400)
    assert "PRIMARY KEY ((shard, bucket), batch_no, seq)" in ddl
    assert "default_time_to_live = 86400" in ddl
    assert "TimeWindowCompactionStrategy" in ddl
    assert "DELETE" not in ddl.upper()
    assert "default_time_to_live = 7200" in alter_retention_ddl("ks", QueueRef("default", "orders"), 7200)


def test_bucket_boundaries() -> None:
    assert bucket_of(0) == 0
    assert bucket_of(BATCHES_PER_BUCKET - 1) == 0
    assert bucket_of(BATCHES_PER_BUCKET) == 1
