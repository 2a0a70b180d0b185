"""Namespaces' passwords, derived from the installation's derivation key.

Every namespace gets a password of its own for each backend: its Cassandra role's (with
keyspace isolation, casque.tenancy) and its ZooKeeper identity's (with ZooKeeper
credentials, casque.backends.zkacl). Each is an HMAC-SHA256 of the namespace keyed with one
installation-wide derivation key (`CASQUE_DERIVATION_KEY`), so the operator recomputes any
of them from its settings at any time and stores nothing.

The key is random and is no login password: every namespace holds its own passwords in its
Secrets, and an HMAC keyed with a login password would let a namespace test guesses of that
password offline, at hundreds of thousands a second. Each use has its own context, so one
key's two uses never give the same password: a namespace's ZooKeeper password says nothing
of its Cassandra one. A new key changes every namespace's passwords (a rotation); a new
login password changes none.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

# 256 bits with `openssl rand -base64 32` (44 characters).
MIN_DERIVATION_KEY = 32
CASSANDRA_ROLE = b"casque cassandra namespace role\x00"
ZOOKEEPER_IDENTITY = b"casque zookeeper namespace identity\x00"


def check_key(key: str, setting: str = "CASQUE_DERIVATION_KEY") -> None:
    """Refuse a key too short to resist offline guessing (the message never shows the key)."""
    if len(key.encode()) < MIN_DERIVATION_KEY:
        raise ValueError(f"{setting} must be a random key of at least {MIN_DERIVATION_KEY} bytes "
                         "(e.g. `openssl rand -base64 32`)")


def derive_password(key: str, context: bytes, namespace: str) -> str:
    """The password of `namespace` for the use `context` names (CASSANDRA_ROLE, ZOOKEEPER_IDENTITY)."""
    check_key(key)
    digest = hmac.new(key.encode(), context + namespace.encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=")
