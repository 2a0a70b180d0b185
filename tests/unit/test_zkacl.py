"""The ZooKeeper ACL policy as pure rules: which ACL a create gets by path, the namespace
identities derived from the installation's, the ACL text form, and the settings' checks."""

from __future__ import annotations

import pytest
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions
from pydantic import SecretStr, ValidationError

from casque.backends.zkacl import (
    NAMESPACE_PERMS,
    Identity,
    format_acl,
    installation_policy,
    namespace_identity,
    namespace_policy,
    parse_acl,
    widen,
)
from casque.config import Settings

OWNER = Identity("casque", "p" * 40)
PREVIOUS = Identity("casque", "q" * 40)


def test_each_path_gets_the_acl_of_its_level() -> None:
    policy = installation_policy("/casque", [OWNER])
    shop = namespace_identity(OWNER, "shop").acl_id
    admin = ACL(Permissions.ALL, OWNER.acl_id)
    for path in ("/casque", "/casque/queues", "/elsewhere", "/casque/queuesx/shop"):
        assert policy.acl_for(path) == [admin]
    assert policy.acl_for("/casque/queues/shop") == [admin, ACL(Permissions.READ, shop)]
    for path in ("/casque/queues/shop/orders", "/casque/queues/shop/orders/subscribers/b/offsets/0"):
        assert policy.acl_for(path) == [admin, ACL(NAMESPACE_PERMS, shop)]
    assert policy.descendant_acl("shop") == [admin, ACL(NAMESPACE_PERMS, shop)]


def test_a_namespace_reads_its_queues_grants_and_never_writes_them() -> None:
    """Grants (casque.engine.grants) bound what the engine acts on: outside the namespace's
    subtree, where the namespace has no create or delete on the parent either."""
    policy = installation_policy("/casque", [OWNER])
    shop = namespace_identity(OWNER, "shop").acl_id
    admin = ACL(Permissions.ALL, OWNER.acl_id)
    assert policy.acl_for("/casque/grants") == [admin]
    for path in ("/casque/grants/shop", "/casque/grants/shop/orders"):
        assert policy.acl_for(path) == [admin, ACL(Permissions.READ, shop)]
    assert policy.acl_for("/casque/grantsx/shop") == [admin]


def test_during_a_rotation_both_passwords_identities_are_in_every_acl() -> None:
    acl = installation_policy("/casque", [OWNER, PREVIOUS]).acl_for("/casque/queues/shop/orders")
    ids = {entry.id for entry in acl}
    assert ids == {OWNER.acl_id, PREVIOUS.acl_id, namespace_identity(OWNER, "shop").acl_id,
                   namespace_identity(PREVIOUS, "shop").acl_id}


def test_namespace_identities_are_stable_distinct_and_tied_to_the_installation_password() -> None:
    shop = namespace_identity(OWNER, "shop")
    assert shop == namespace_identity(OWNER, "shop")
    assert shop.username == "casque.shop" and len(shop.password) >= 32
    assert shop.password != namespace_identity(OWNER, "shop2").password
    assert shop.password != namespace_identity(PREVIOUS, "shop").password


def test_a_sidecar_creates_everything_with_the_acl_it_was_given() -> None:
    given = installation_policy("/casque", [OWNER]).descendant_acl("shop")
    policy = namespace_policy("/casque", given)
    for path in ("/casque/queues/shop/orders/redrive", "/casque/queues/other/x", "/casque"):
        assert policy.acl_for(path) == given


def test_widening_touches_only_read_only_entries() -> None:
    assert widen(OPEN_ACL_UNSAFE) == OPEN_ACL_UNSAFE  # an installation without ACLs stays open
    reader = ACL(Permissions.READ, Id("digest", "a:b"))
    assert widen([reader]) == [ACL(NAMESPACE_PERMS, Id("digest", "a:b"))]


def test_the_text_form_round_trips_and_refuses_garbage() -> None:
    acl = installation_policy("/casque", [OWNER]).descendant_acl("shop")
    text = format_acl(acl)
    assert text.startswith("digest:casque:") and text.endswith(":rwcd")
    assert parse_acl(text) == acl
    for bad in ("", "digest", "digest:x", "digest:a:b:rwz"):
        with pytest.raises(ValueError):
            parse_acl(bad)


def test_identities_never_show_their_password() -> None:
    assert OWNER.password not in repr(OWNER)
    settings = Settings(zookeeper_username="casque", zookeeper_password=SecretStr(OWNER.password))
    assert OWNER.password not in repr(settings) and OWNER.password not in str(settings.model_dump())


@pytest.mark.parametrize("fields, message", [
    ({"zookeeper_username": "casque"}, "go together"),
    ({"zookeeper_password": "p" * 40}, "go together"),
    ({"zookeeper_username": "casque", "zookeeper_password": "short"}, "at least 32"),
    ({"zookeeper_previous_password": "p" * 40}, "needs CASQUE_ZOOKEEPER_PASSWORD"),
])
def test_settings_refuse_half_or_weak_credentials(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**fields)  # type: ignore[arg-type]
