"""A namespace's quota on znodes as ZooKeeper keeps it (casque.engine.znode_quotas) and as the
operator reads it (casque.operator.quotas)."""

from __future__ import annotations

import pytest

from casque.engine.znode_quotas import ZnodeQuota, limits_data, quota_path, split_chroot
from casque.errors import InvalidSpec
from casque.operator.quotas import MAX_ZNODE_BYTES, MAX_ZNODES, QuotaSettings, limits_for


def test_the_chroot_is_split_from_the_servers_and_goes_into_the_quotas_path() -> None:
    assert split_chroot("a:2181,b:2181/tenants/casque") == ("a:2181,b:2181", "/tenants/casque")
    assert split_chroot("a:2181/") == ("a:2181", "")
    assert split_chroot("a:2181") == ("a:2181", "")
    assert quota_path("/tenants", "/casque/queues/shop") == "/zookeeper/quota/tenants/casque/queues/shop"
    assert quota_path("", "/casque/queues/shop") == "/zookeeper/quota/casque/queues/shop"


def test_the_limits_are_hard_and_minus_one_is_none() -> None:
    assert limits_data(ZnodeQuota(max_znodes=100_000)) == b"count=-1,bytes=-1,countHardLimit=100000,byteHardLimit=-1"
    assert limits_data(ZnodeQuota(max_bytes=1 << 20)) == b"count=-1,bytes=-1,countHardLimit=-1,byteHardLimit=1048576"
    assert ZnodeQuota().unbounded and not ZnodeQuota(max_bytes=1).unbounded
    assert ZnodeQuota(max_znodes=5, max_bytes=9).describe() == "at most 5 znodes, 9 bytes"
    assert ZnodeQuota().describe() == "lifted"


def test_the_namespace_annotation_overrides_the_default_and_zero_is_refused() -> None:
    defaults = QuotaSettings(max_znodes=100_000, max_znode_bytes=64 << 20)
    assert limits_for(defaults, None).znodes == ZnodeQuota(max_znodes=100_000, max_bytes=64 << 20)
    assert limits_for(defaults, {MAX_ZNODES: "5000"}).znodes == ZnodeQuota(max_znodes=5000, max_bytes=64 << 20)
    assert limits_for(defaults, {MAX_ZNODES: "", MAX_ZNODE_BYTES: "4096"}).znodes == ZnodeQuota(max_bytes=4096)
    assert limits_for(defaults, {MAX_ZNODE_BYTES: ""}).znodes == ZnodeQuota(max_znodes=100_000)
    assert not limits_for(defaults, None).any, "znodes are ZooKeeper's to count, not the operator's"
    for key in (MAX_ZNODES, MAX_ZNODE_BYTES):
        for bad in ("0", "many", "64Mi"):
            with pytest.raises(InvalidSpec, match=key.rpartition("/")[2]):
                limits_for(defaults, {key: bad})
