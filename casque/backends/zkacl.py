"""Who may touch which znode: ZooKeeper identities and the ACL every create carries.

Two kinds of identity authenticate to ZooKeeper:

- the installation identity (the operator, `casque apply`, an administrator's CLI), from
  the settings. It holds every permission on every znode of the installation. It logs in
  with the digest scheme (`user:password`, ACL entries `digest:<user>:<SHA-1 hash>`) or, with
  `CASQUE_ZOOKEEPER_SASL=true`, over SASL DIGEST-MD5 against a user of the servers' JAAS
  file (ACL entries `sasl:<user>`, which name no password).
- one identity per Kubernetes namespace, for that namespace's sidecars, always digest. Its
  name is `<installation user>.<namespace>` and its password is derived from the
  installation's derivation key (casque.derivation), never from the installation password,
  so the operator can recreate it from its own settings at any time and needs to store
  nothing; the operator hands it to the namespace in a Secret. (SASL DIGEST-MD5 users are
  fixed in the servers' JAAS file, read at their start, so the operator could not create one
  per namespace.)

The ACLs, by path (ZooKeeper checks only the ACL of the znode an operation names, and a
create or delete the ACL of the parent, never the ancestors'). Below a namespace znode a
znode's ACL follows what the znode is (`namespace_perms`), not merely where it is: the
installation has every right everywhere, and the namespace's identity what its sidecars
need there and no more:

    {root}, {root}/queues                  installation only
    {root}/queues/<ns>                     <ns>: read (it lists its queues, and cannot create
                                           or delete queues itself)
    .../<ns>/<q>                           <ns>: read. The queue's spec: written, and its
                                           children (shards, subscribers, mover, redrive)
                                           created, by the installation alone
    .../<q>/shards, .../shards/<s>         <ns>: read. The shard layout: no head for a shard
                                           the queue does not have
    .../shards/<s>/head, .../totals        <ns>: read, write (publishers advance them)
    .../<q>/redrive                        <ns>: read, write (redrive marks)
    .../<q>/mover, and below               <ns>: read, write, create, delete (the mover's
                                           cursor and its election)
    .../<q>/publishers, and below          <ns>: read, write, create, delete (its publishing
                                           sidecars' presence, casque.engine.presence)
    .../<q>/subscribers                    <ns>: read
    .../subscribers/<sub>                  <ns>: read. The subscriber's spec (pushUrl,
                                           maxDeliveries, ...), and the set of its children
    .../<sub>/offsets                      <ns>: read (one offset per shard, made by the installation)
    .../<sub>/offsets/<s>, .../<sub>/seek  <ns>: read, write (commits and seeks)
    .../<sub>/members, leases, fences,     <ns>: read, write, create, delete: the znodes its
      cursors, claims, and below           sidecars create and delete (the ACL it is given)
    anything else below <ns>               <ns>: read
    {root}/grants/<ns>, and below          <ns>: read (what the operator granted its queues,
                                           casque.engine.grants: never the namespace's to write)
    {root}/protocol                        anyone: read (the installation's protocol version,
                                           casque.engine.protocol: every sidecar follows it)

So the installation creates every container znode (with the queue or the subscriber, or
with a later apply for one made by an older casque), and a sidecar only ever creates below
the containers it owns. A sidecar puts one ACL on all it creates, the owned one.

No identity but the installation's has ADMIN anywhere, so a namespace can neither change
an ACL nor lock the operator out of its znodes. Reads are restricted too: one namespace
cannot read another's offsets, members or subscriber settings (only `exists` is not
checked by ZooKeeper, so the existence of a znode is not secret).

A namespace's sidecar does not know the installation password, and ZooKeeper masks the
digests in the ACLs it reads back to anyone without ADMIN, so the sidecar cannot learn the
installation's part of the ACL from the server: the operator writes the ACL of the znodes
its sidecars create (the owned one) into the namespace's Secret (`CASQUE_ZOOKEEPER_ACL`, in
ZooKeeper's `scheme:id:perms` form), and the sidecar puts exactly that on what it creates. The digests
in it are SHA-1 hashes of high-entropy passwords (settings refuse short ones). While the
installation password is being rotated, both passwords' identities are in every ACL, so
the operator reaches every znode with either; while the derivation key is being rotated,
each namespace's identities from both keys are, so sidecars holding either keep working
until they restart.

`AclClient` is a KazooClient that puts the ACL of this policy on every create, including the
parents that `makepath`/`ensure_path` create and the creates of a transaction, so no code
path can create a znode with another ACL by forgetting to pass one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kazoo.client import KazooClient, TransactionRequest
from kazoo.security import ACL, ANYONE_ID_UNSAFE, Id, Permissions, make_digest_acl_credential

from casque.derivation import ZOOKEEPER_IDENTITY, derive_password

# What a namespace's identity may do on a znode below its namespace znode, by what the
# znode is (`namespace_perms`). Never ADMIN.
READ_ONLY: int = Permissions.READ
# Made by the installation, written by sidecars: heads, totals, offsets, seek records.
WRITABLE: int = Permissions.READ | Permissions.WRITE
# The containers whose children sidecars create and delete, and those children. It is also
# the ACL a sidecar puts on everything it creates (`AclPolicy.descendant_acl`).
NAMESPACE_PERMS: int = Permissions.READ | Permissions.WRITE | Permissions.CREATE | Permissions.DELETE

# Below a subscriber's znode: the containers its sidecars create and delete in (members,
# leases, lease fences, shared delivery's cursors and claims). casque.znodes names them.
SUBSCRIBER_OWNED = frozenset({"members", "leases", "fences", "cursors", "claims"})


def namespace_perms(below: Sequence[str]) -> int:
    """The namespace identity's permissions on `{root}/queues/<ns>/<below...>` (the path's
    segments below the namespace znode, casque.znodes' layout).

    Spec znodes (the queue's, its subscribers') and the znodes that give the queue its shape
    (shards, the subscribers container, a subscriber's offsets container) are read-only: a
    namespace can neither rewrite a spec nor create a shard, a head, a subscriber or an
    offset. A path the layout does not know is read-only too, so a znode a future casque
    adds is closed until this policy names it.
    """
    match list(below):
        case [_, "shards", _, "head" | "totals"] | [_, "redrive"]:
            return WRITABLE
        case [_, "subscribers", _, "offsets", _] | [_, "subscribers", _, "seek"]:
            return WRITABLE
        case [_, "subscribers", _, owned, *_] if owned in SUBSCRIBER_OWNED:
            return NAMESPACE_PERMS
        case [_, "mover" | "publishers", *_]:
            return NAMESPACE_PERMS
        case _:
            return READ_ONLY


# How an identity logs in, and so the scheme of its ACL entries.
Scheme = Literal["digest", "sasl"]
SASL_MECHANISM = "DIGEST-MD5"


@dataclass(frozen=True)
class Identity:
    """A ZooKeeper identity, digest unless `scheme` says SASL. `repr` never shows the password."""

    username: str
    password: str = field(repr=False)
    scheme: Scheme = "digest"

    @property
    def auth(self) -> tuple[str, str]:
        """The (scheme, credential) pair for kazoo's `auth_data` (a digest identity's)."""
        if self.scheme != "digest":
            raise ValueError(f"a {self.scheme} identity logs in with sasl_options, not auth_data")
        return ("digest", f"{self.username}:{self.password}")

    @property
    def sasl_options(self) -> dict[str, str]:
        """kazoo's `sasl_options` for a SASL identity (handed to pure-sasl)."""
        if self.scheme != "sasl":
            raise ValueError("a digest identity logs in with auth_data, not sasl_options")
        return {"mechanism": SASL_MECHANISM, "username": self.username, "password": self.password}

    @property
    def acl_id(self) -> Id:
        """What ZooKeeper stores in an ACL for this identity: for digest the user and a SHA-1
        of user:password; for SASL the user alone (the password is the servers' JAAS file's)."""
        if self.scheme == "sasl":
            return Id("sasl", self.username)
        return Id("digest", make_digest_acl_credential(self.username, self.password))


def namespace_identity(installation_user: str, derivation_key: str, namespace: str) -> Identity:
    """The digest identity of `namespace`'s sidecars, `<installation user>.<namespace>`, its
    password derived from the installation's derivation key (whether the installation logs
    in with digest or SASL).

    A keyed hash rather than a random password stored somewhere: the operator (and
    `casque apply`) can compute every namespace's ACL from its settings alone, and a new key
    rotates every namespace's identity. Not keyed with the installation password: each
    namespace holds its own password, which would let it test guesses of that one offline.
    """
    return Identity(f"{installation_user}.{namespace}", derive_password(derivation_key, ZOOKEEPER_IDENTITY, namespace))


def widen(namespace_acl: Sequence[ACL], perms: int = NAMESPACE_PERMS) -> list[ACL]:
    """The ACL of a znode below a namespace znode, from the namespace znode's own ACL: the
    read-only entries (the namespace's identities) get `perms`; the installation's keep all."""
    return [
        ACL(perms, entry.id) if entry.perms == Permissions.READ else ACL(entry.perms, entry.id)
        for entry in namespace_acl
    ]


@dataclass(frozen=True)
class AclPolicy:
    """The ACL of a create, by path (paths as the client sees them, under its chroot).

    `namespace_acl(ns)` gives the ACL of `{root}/queues/<ns>`; a znode below it gets that
    ACL with the namespace's permissions of `namespace_perms`. Anything else gets
    `installation_acl`.
    """

    root: str
    installation_acl: tuple[ACL, ...]
    namespace_acl: Callable[[str], Sequence[ACL]]
    # A sidecar's policy: one ACL for everything it creates.
    below_only: bool = False

    def acl_for(self, path: str) -> list[ACL]:
        if self.below_only:
            return list(self.installation_acl)
        if path == f"{self.root.rstrip('/')}/protocol":
            return [*self.installation_acl, ACL(Permissions.READ, ANYONE_ID_UNSAFE)]
        granted = self.grants_of(path)
        if granted is not None:
            return list(self.namespace_acl(granted))
        namespace, below = self.split(path)
        if namespace is None:
            return list(self.installation_acl)
        acl = self.namespace_acl(namespace)
        return widen(acl, namespace_perms(below)) if below else list(acl)

    def descendant_acl(self, namespace: str) -> list[ACL]:
        """The ACL its sidecars create with: the owned one (NAMESPACE_PERMS), which the
        server lets them use only below the containers they own."""
        return widen(self.namespace_acl(namespace))

    def grants_of(self, path: str) -> str | None:
        """The namespace of a path at or under `{root}/grants/<ns>`; None for any other path."""
        prefix = f"{self.root.rstrip('/')}/grants/"
        if not path.startswith(prefix):
            return None
        return path[len(prefix):].partition("/")[0] or None

    def split(self, path: str) -> tuple[str | None, tuple[str, ...]]:
        """(namespace, the path's segments below the namespace znode) for a path under
        `{root}/queues/<ns>`; (None, ()) for any other path."""
        prefix = f"{self.root.rstrip('/')}/queues/"
        if not path.startswith(prefix):
            return None, ()
        namespace, _, rest = path[len(prefix):].partition("/")
        return (namespace or None), tuple(rest.split("/")) if rest else ()


def installation_policy(root: str, identities: Sequence[Identity], derivation_keys: Sequence[str]) -> AclPolicy:
    """The operator's view: it knows every identity, so it computes every ACL.

    `identities` are the installation's current identity and, while its password is being
    rotated, the previous one. `derivation_keys` are the current derivation key and, while it
    is being rotated, the previous one; each brings every namespace's identity from that key
    into the ACLs.
    """
    if identities and not derivation_keys:
        # Without one no namespace identity would be in any ACL: every sidecar refused.
        raise ValueError("the installation's ZooKeeper credentials need CASQUE_DERIVATION_KEY, "
                         "the key each namespace's identity is derived from")
    # With SASL both passwords' identities have one ACL entry (`sasl:<user>`): once is enough.
    admins = tuple(dict.fromkeys(ACL(Permissions.ALL, identity.acl_id) for identity in identities))
    users = list(dict.fromkeys(identity.username for identity in identities))

    def namespace_acl(namespace: str) -> list[ACL]:
        readers = [ACL(Permissions.READ, namespace_identity(user, key, namespace).acl_id)
                   for key in derivation_keys for user in users]
        return [*admins, *readers]

    return AclPolicy(root, admins, namespace_acl)


def namespace_policy(root: str, descendant_acl: Sequence[ACL]) -> AclPolicy:
    """A namespace sidecar's view: whatever it creates carries the ACL the operator gave it
    (the ACL of the znodes below its namespace). It has no right to create anywhere else,
    and the server refuses it there whatever ACL it sends."""
    fixed = tuple(descendant_acl)
    return AclPolicy(root, fixed, lambda namespace: fixed, below_only=True)


PERM_LETTERS = {"r": Permissions.READ, "w": Permissions.WRITE, "c": Permissions.CREATE,
                "d": Permissions.DELETE, "a": Permissions.ADMIN}


def format_acl(acl: Sequence[ACL]) -> str:
    """`scheme:id:perms,...` as ZooKeeper's own tools write it, e.g. `digest:casque:HASH=:cdrwa`."""
    def letters(perms: int) -> str:
        return "".join(letter for letter, bit in PERM_LETTERS.items() if perms & bit)
    return ",".join(f"{entry.id.scheme}:{entry.id.id}:{letters(entry.perms)}" for entry in acl)


def parse_acl(text: str) -> list[ACL]:
    acl = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        scheme, _, rest = part.partition(":")
        identity, _, letters = rest.rpartition(":")
        if not scheme or not identity or not letters or set(letters) - set(PERM_LETTERS):
            raise ValueError(f"{part!r} is not an ACL entry of the form scheme:id:perms (perms of cdrwa)")
        perms = 0
        for letter in letters:
            perms |= PERM_LETTERS[letter]
        acl.append(ACL(perms, Id(scheme, identity)))
    if not acl:
        raise ValueError("an ACL needs at least one entry")
    return acl


class AclClient(KazooClient):  # type: ignore[misc]  # kazoo is untyped
    """A KazooClient whose every create carries `policy.acl_for(path)`.

    kazoo's `ensure_path` and `create(makepath=True)` pass the ACL of the node being created
    down to its missing parents; here each parent gets its own path's ACL instead, so
    `{root}/queues/<ns>` created as the parent of a queue is readable by the namespace but
    not writable by it.
    """

    def __init__(self, policy: AclPolicy, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.acl_policy = policy

    def create_async(self, path: str, value: bytes = b"", acl: Any = None, *args: Any, **kwargs: Any) -> Any:
        return super().create_async(path, value, self.acl_policy.acl_for(path), *args, **kwargs)

    def ensure_path_async(self, path: str, acl: Any = None) -> Any:
        # kazoo's ensure_path creates through create_async, which sets each node's ACL.
        return super().ensure_path_async(path, None)

    def transaction(self) -> TransactionRequest:
        return _AclTransaction(self)


class _AclTransaction(TransactionRequest):  # type: ignore[misc]  # kazoo is untyped
    client: AclClient

    def create(self, path: str, value: bytes = b"", acl: Any = None, *args: Any, **kwargs: Any) -> None:
        super().create(path, value, self.client.acl_policy.acl_for(path), *args, **kwargs)
