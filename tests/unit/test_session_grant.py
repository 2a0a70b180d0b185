"""The session timeout ZooKeeper granted, without a server: a client that does not keep it
has no timeout to trust a session for, rather than the one it asked for."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient

from casque.backends import zk


def test_a_client_that_does_not_keep_its_grant_tells_none() -> None:
    with pytest.raises(ValueError, match="granted"):
        zk.granted_session_seconds(KazooClient(hosts="127.0.0.1:1", timeout=120))


def test_a_client_keeps_its_grant_once_and_has_none_before_its_first_connect() -> None:
    client = zk.keep_granted_timeout(KazooClient(hosts="127.0.0.1:1", timeout=120))
    handler = client._connection
    assert zk.keep_granted_timeout(client) is client and client._connection is handler
    with pytest.raises(ValueError, match="granted"):
        zk.granted_session_seconds(client)
