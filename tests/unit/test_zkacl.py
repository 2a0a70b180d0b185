"""The ZooKeeper ACL policy as pure rules: which ACL a create gets by path, the namespace
identities derived from the installation's derivation key, the ACL text form, and the
settings' checks."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions
from pydantic import SecretStr, ValidationError

from casque.backends.zkacl import (
    NAMESPACE_PERMS,
    SUBSCRIBER_OWNED,
    WRITABLE,
    Identity,
    format_acl,
    installation_policy,
    namespace_identity,
    namespace_perms,
    namespace_policy,
    parse_acl,
    widen,
)
from casque.config import Settings
from casque.schema import QueueRef
from casque.znodes import queue_paths

OWNER = Identity("casque", "p" * 40)
PREVIOUS = Identity("casque", "q" * 40)
KEY = "k" * 40
PREVIOUS_KEY = "j" * 40


def test_each_path_gets_the_acl_of_its_level() -> None:
    policy = installation_policy("/casque", [OWNER], [KEY])
    shop = namespace_identity("casque", KEY, "shop").acl_id
    admin = ACL(Permissions.ALL, OWNER.acl_id)
    for path in ("/casque", "/casque/queues", "/elsewhere", "/casque/queuesx/shop"):
        assert policy.acl_for(path) == [admin]
    assert policy.acl_for("/casque/queues/shop") == [admin, ACL(Permissions.READ, shop)]
    assert policy.acl_for("/casque/queues/shop/orders") == [admin, ACL(Permissions.READ, shop)]
    assert policy.acl_for("/casque/queues/shop/orders/subscribers/b/offsets/0") == [admin, ACL(WRITABLE, shop)]
    assert policy.acl_for("/casque/queues/shop/orders/subscribers/b/members/m") == [admin, ACL(NAMESPACE_PERMS, shop)]
    assert policy.descendant_acl("shop") == [admin, ACL(NAMESPACE_PERMS, shop)]


# What a namespace's identity may do on each znode of a queue, by what the znode is.
PATHS = queue_paths("/casque", QueueRef("shop", "orders"))
SUB = PATHS.subscriber("billing")
NAMESPACE_RIGHTS = [
    # The specs, and the znodes that make the queue's shape: read only.
    (PATHS.base, Permissions.READ),
    (PATHS.shards, Permissions.READ),
    (f"{PATHS.shards}/0", Permissions.READ),
    (PATHS.subscribers, Permissions.READ),
    (SUB.base, Permissions.READ),
    (SUB.offsets, Permissions.READ),
    # Made by the installation, written by publishers, consumers and seeks.
    (PATHS.head(0), WRITABLE),
    (PATHS.totals(3), WRITABLE),
    (PATHS.redrive, WRITABLE),
    (SUB.offset(0), WRITABLE),
    (SUB.seek, WRITABLE),
    # The containers its sidecars create and delete in, and what they create there.
    (SUB.members, NAMESPACE_PERMS),
    (SUB.member("m-1"), NAMESPACE_PERMS),
    (SUB.leases, NAMESPACE_PERMS),
    (SUB.lease(2), NAMESPACE_PERMS),
    (SUB.fences, NAMESPACE_PERMS),
    (SUB.fence(2), NAMESPACE_PERMS),
    (SUB.cursors, NAMESPACE_PERMS),
    (SUB.cursor(1), NAMESPACE_PERMS),
    (SUB.claims_root, NAMESPACE_PERMS),
    (SUB.claims(1), NAMESPACE_PERMS),
    (f"{SUB.claims(1)}/0-12", NAMESPACE_PERMS),
    (PATHS.mover, NAMESPACE_PERMS),
    (f"{PATHS.mover}/election/abc__lock__0000000001", NAMESPACE_PERMS),
    (PATHS.publishers, NAMESPACE_PERMS),
    (PATHS.publisher("pod-1a2b3c"), NAMESPACE_PERMS),
    # Whatever the layout does not name: read only, so nothing new is open by accident.
    (f"{PATHS.base}/rogue", Permissions.READ),
    (f"{PATHS.shards}/0/rogue", Permissions.READ),
    (f"{PATHS.head(0)}/below", Permissions.READ),
    (f"{SUB.base}/rogue", Permissions.READ),
    (f"{SUB.offset(0)}/below", Permissions.READ),
    (f"{SUB.seek}/below", Permissions.READ),
]


@pytest.mark.parametrize("path, perms", NAMESPACE_RIGHTS)
def test_a_namespace_writes_what_its_sidecars_write_and_reads_the_rest(path: str, perms: int) -> None:
    policy = installation_policy("/casque", [OWNER], [KEY])
    shop = namespace_identity("casque", KEY, "shop").acl_id
    assert policy.acl_for(path) == [ACL(Permissions.ALL, OWNER.acl_id), ACL(perms, shop)]
    assert not perms & Permissions.ADMIN


def test_a_namespace_can_neither_rewrite_a_spec_nor_add_a_shard_a_head_a_subscriber_or_an_offset() -> None:
    """The attacks of issue 31, as rules: a set of a spec needs WRITE on it; a create of a
    head for a shard the queue lacks needs CREATE on `shards`; a subscriber or an offset,
    CREATE on their containers."""
    below = PATHS.base.removeprefix("/casque/queues/shop/").split("/")
    for spec in ([*below], [*below, "subscribers", "billing"]):
        assert not namespace_perms(spec) & (Permissions.WRITE | Permissions.CREATE | Permissions.DELETE)
    for container in ([*below, "shards"], [*below, "shards", "9255"], [*below, "subscribers"],
                      [*below, "subscribers", "billing", "offsets"]):
        assert not namespace_perms(container) & (Permissions.CREATE | Permissions.DELETE)


def test_a_sidecar_owns_only_the_containers_named_in_the_layout() -> None:
    """casque.znodes is the layout's one home; the policy names its containers by their last
    segment, so each must be one of the layout's."""
    named = {SUB.members, SUB.leases, SUB.fences, SUB.cursors, SUB.claims_root}
    assert {path.rsplit("/", 1)[1] for path in named} == SUBSCRIBER_OWNED


def test_a_namespace_reads_its_queues_grants_and_never_writes_them() -> None:
    """Grants (casque.engine.grants) bound what the engine acts on: outside the namespace's
    subtree, where the namespace has no create or delete on the parent either."""
    policy = installation_policy("/casque", [OWNER], [KEY])
    shop = namespace_identity("casque", KEY, "shop").acl_id
    admin = ACL(Permissions.ALL, OWNER.acl_id)
    assert policy.acl_for("/casque/grants") == [admin]
    for path in ("/casque/grants/shop", "/casque/grants/shop/orders"):
        assert policy.acl_for(path) == [admin, ACL(Permissions.READ, shop)]
    assert policy.acl_for("/casque/grantsx/shop") == [admin]


def test_during_a_password_rotation_both_installation_identities_are_in_every_acl() -> None:
    acl = installation_policy("/casque", [OWNER, PREVIOUS], [KEY]).acl_for("/casque/queues/shop/orders")
    # The namespace's identity does not change with the installation password.
    shop = namespace_identity("casque", KEY, "shop").acl_id
    assert [entry.id for entry in acl] == [OWNER.acl_id, PREVIOUS.acl_id, shop]


def test_during_a_key_rotation_both_keys_namespace_identities_are_in_every_namespace_acl() -> None:
    policy = installation_policy("/casque", [OWNER], [KEY, PREVIOUS_KEY])
    new, old = (namespace_identity("casque", key, "shop").acl_id for key in (KEY, PREVIOUS_KEY))
    assert [entry.id for entry in policy.acl_for("/casque/queues/shop/orders")] == [OWNER.acl_id, new, old]
    assert [entry.id for entry in policy.acl_for("/casque/grants/shop")] == [OWNER.acl_id, new, old]
    assert policy.acl_for("/casque/queues") == [ACL(Permissions.ALL, OWNER.acl_id)]


def test_namespace_identities_are_stable_distinct_and_tied_to_the_derivation_key() -> None:
    shop = namespace_identity("casque", KEY, "shop")
    assert shop == namespace_identity("casque", KEY, "shop")
    assert shop.username == "casque.shop" and len(shop.password) >= 32
    assert shop.password != namespace_identity("casque", KEY, "shop2").password
    assert shop.password != namespace_identity("casque", PREVIOUS_KEY, "shop").password
    assert KEY not in shop.password


def test_the_identities_from_before_the_key_are_a_previous_key_equal_to_the_installation_password() -> None:
    """docs/security.md's upgrade: namespaces' identities used to be HMACs keyed with the
    installation password, with the same context; that password as the previous key keeps
    them in the ACLs while sidecars still hold them."""
    before = base64.urlsafe_b64encode(hmac.new(OWNER.password.encode(), b"casque zookeeper namespace identity\x00shop",
                                               hashlib.sha256).digest()).decode().rstrip("=")
    assert namespace_identity("casque", OWNER.password, "shop").password == before
    assert namespace_identity("casque", KEY, "shop").password != before


def test_a_policy_without_a_derivation_key_is_refused() -> None:
    """No namespace identity could be in any ACL: every sidecar would be refused."""
    with pytest.raises(ValueError, match="CASQUE_DERIVATION_KEY"):
        installation_policy("/casque", [OWNER], [])
    assert installation_policy("/casque", [], []).acl_for("/casque") == []  # no credentials: open


def test_a_short_derivation_key_is_refused_without_showing_it() -> None:
    weak = "w" * 31
    with pytest.raises(ValueError, match="at least 32 bytes") as refused:
        namespace_identity("casque", weak, "shop")
    assert weak not in str(refused.value)


def test_a_sidecar_creates_everything_with_the_acl_it_was_given() -> None:
    given = installation_policy("/casque", [OWNER], [KEY]).descendant_acl("shop")
    policy = namespace_policy("/casque", given)
    for path in ("/casque/queues/shop/orders/redrive", "/casque/queues/other/x", "/casque"):
        assert policy.acl_for(path) == given


def test_widening_touches_only_read_only_entries() -> None:
    assert widen(OPEN_ACL_UNSAFE) == OPEN_ACL_UNSAFE  # an installation without ACLs stays open
    assert widen(OPEN_ACL_UNSAFE, WRITABLE) == OPEN_ACL_UNSAFE
    reader = ACL(Permissions.READ, Id("digest", "a:b"))
    assert widen([reader]) == [ACL(NAMESPACE_PERMS, Id("digest", "a:b"))]
    assert widen([reader], WRITABLE) == [ACL(WRITABLE, Id("digest", "a:b"))]


def test_the_text_form_round_trips_and_refuses_garbage() -> None:
    acl = installation_policy("/casque", [OWNER], [KEY]).descendant_acl("shop")
    text = format_acl(acl)
    assert text.startswith("digest:casque:") and text.endswith(":rwcd")
    assert parse_acl(text) == acl
    for bad in ("", "digest", "digest:x", "digest:a:b:rwz"):
        with pytest.raises(ValueError):
            parse_acl(bad)


def test_identities_never_show_their_password() -> None:
    assert OWNER.password not in repr(OWNER)
    settings = Settings(zookeeper_username="casque", zookeeper_password=SecretStr(OWNER.password),
                        derivation_key=SecretStr(KEY))
    for secret in (OWNER.password, KEY):
        assert secret not in repr(settings) and secret not in str(settings.model_dump())


@pytest.mark.parametrize("fields, message", [
    ({"zookeeper_username": "casque"}, "go together"),
    ({"zookeeper_password": "p" * 40}, "go together"),
    ({"zookeeper_username": "casque", "zookeeper_password": "short"}, "at least 32"),
    ({"zookeeper_previous_password": "p" * 40}, "needs CASQUE_ZOOKEEPER_PASSWORD"),
    ({"zookeeper_username": "casque", "zookeeper_password": "p" * 40}, "need CASQUE_DERIVATION_KEY"),
    ({"zookeeper_username": "casque", "zookeeper_password": "p" * 40, "derivation_key": "k" * 31},
     "CASQUE_DERIVATION_KEY must be a random key of at least 32 bytes"),
    ({"zookeeper_username": "casque", "zookeeper_password": "p" * 40, "derivation_key": "k" * 40,
      "previous_derivation_key": "j" * 31}, "CASQUE_PREVIOUS_DERIVATION_KEY must be a random key of at least 32 bytes"),
    ({"previous_derivation_key": "j" * 40}, "CASQUE_PREVIOUS_DERIVATION_KEY needs CASQUE_DERIVATION_KEY"),
])
def test_settings_refuse_half_or_weak_credentials(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        Settings(**fields)  # type: ignore[arg-type]
    assert not [value for value in fields.values() if len(value) > 8 and value in str(refused.value)]
