"""A namespace's quota on znodes as ZooKeeper keeps it (casque.engine.znode_quotas) and as the
operator reads it (casque.operator.quotas)."""

from __future__ import annotations

import pytest

from casque.engine.znode_quotas import limits_data, quota_path, split_chroot
from casque.errors import InvalidSpec
from casque.operator.quotas import MAX_ZNODES, QuotaSettings, limits_for


def test_the_chroot_is_split_from_the_servers_and_goes_into_the_quotas_path() -> None:
    assert split_chroot("a:2181,b:2181/tenants/casque") == ("a:2181,b:2181", "/tenants/casque")
    assert split_chroot("a:2181/") == ("a:2181", "")
    assert split_chroot("a:2181") == ("a:2181", "")
    assert quota_path("/tenants", "/casque/queues/shop") == "/zookeeper/quota/tenants/casque/queues/shop"
    assert quota_path("", "/casque/queues/shop") == "/zookeeper/quota/casque/queues/shop"


def test_the_limits_are_a_hard_count_alone() -> None:
    assert limits_data(100_000) == b"count=-1,bytes=-1,countHardLimit=100000,byteHardLimit=-1"


def test_the_namespace_annotation_overrides_the_default_and_zero_is_refused() -> None:
    defaults = QuotaSettings(max_znodes=100_000)
    assert limits_for(defaults, None).max_znodes == 100_000
    assert limits_for(defaults, {MAX_ZNODES: "5000"}).max_znodes == 5000
    assert limits_for(defaults, {MAX_ZNODES: ""}).max_znodes is None
    assert not limits_for(defaults, None).any, "znodes are ZooKeeper's to count, not the operator's"
    for bad in ("0", "many"):
        with pytest.raises(InvalidSpec, match="max-znodes"):
            limits_for(defaults, {MAX_ZNODES: bad})
