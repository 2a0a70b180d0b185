"""Where a namespace's Cassandra data lives and who may reach it, with keyspace isolation on.

Cassandra grants rights per keyspace or table, never per row, so a namespace that must not
read another's messages needs tables of its own: with `CASQUE_CASSANDRA_ISOLATION=keyspace`
each Kubernetes namespace gets a keyspace (its queues' tables and its own copy of the shared
tables) and a role that may read and write that keyspace only. Both are derived here, from
the installation's settings alone:

- the keyspace: the installation keyspace, `_` and the namespace with `-` turned into `_`
  (namespaces are DNS labels, which have no `_`, so this is one-to-one). A name too long
  for Cassandra's 48 characters keeps a readable prefix and ends in a hash of the whole
  namespace; plain names are kept shorter than hashed ones, so the two forms never meet.
- the role: named like the keyspace, so `LIST ROLES` and `DESCRIBE` read alike.
- the role's password: derived from the installation's derivation key (casque.derivation,
  `CASQUE_DERIVATION_KEY`), never from a login password. Changing the key changes every
  namespace's password (a rotation); changing the installation's password changes none.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from casque.config import MAX_ISOLATED_KEYSPACE
from casque.derivation import CASSANDRA_ROLE, derive_password
from casque.errors import InvalidSpec
from casque.schema import validate_name

# Cassandra's limit for keyspace (and table) names.
MAX_KEYSPACE_LENGTH = 48
# Hex digits of SHA-256 that end a shortened name: 48 bits, far beyond a namespace name
# crafted to collide with another.
HASH_LENGTH = 12
# Names without a hash stay below the length of every hashed name (48), so that a short
# namespace that happens to end in `_<12 hex>` can never take a long namespace's keyspace.
MAX_PLAIN_LENGTH = MAX_KEYSPACE_LENGTH - HASH_LENGTH - 1


@dataclass(frozen=True)
class NamespaceRole:
    """A namespace's Cassandra login and the keyspace it may use. `repr` hides the password."""

    keyspace: str
    username: str
    password: str = field(repr=False)


def namespace_keyspace(installation_keyspace: str, namespace: str) -> str:
    """The keyspace of `namespace`'s queues and shared tables."""
    if len(installation_keyspace) > MAX_ISOLATED_KEYSPACE:
        raise InvalidSpec(
            f"keyspace {installation_keyspace!r} is longer than {MAX_ISOLATED_KEYSPACE} characters, "
            "too long to prefix a keyspace per namespace; choose a shorter CASQUE_KEYSPACE"
        )
    validate_name("namespace", namespace)
    plain = f"{installation_keyspace}_{namespace.replace('-', '_')}"
    if len(plain) <= MAX_PLAIN_LENGTH:
        return plain
    digest = hashlib.sha256(namespace.encode()).hexdigest()[:HASH_LENGTH]
    return f"{plain[:MAX_KEYSPACE_LENGTH - HASH_LENGTH - 1]}_{digest}"


def namespace_role(installation_keyspace: str, derivation_key: str, namespace: str) -> NamespaceRole:
    """The role `namespace`'s sidecars log in with, its password derived from `derivation_key`."""
    keyspace = namespace_keyspace(installation_keyspace, namespace)
    try:
        password = derive_password(derivation_key, CASSANDRA_ROLE, namespace)
    except ValueError as error:
        raise InvalidSpec(f"keyspace isolation derives each namespace's password from a key: {error}") from error
    return NamespaceRole(keyspace=keyspace, username=keyspace, password=password)
