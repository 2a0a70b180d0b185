"""Connection settings shared by every casque process, read from CASQUE_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from casque.derivation import MIN_DERIVATION_KEY, check_key

# e.g. `openssl rand -base64 32` gives 44.
MIN_ZOOKEEPER_PASSWORD = 32
# Cassandra tries a password online only (nothing derived from it is handed out), but a
# short one still falls to guessing: `cassandra` is the default superuser's.
MIN_CASSANDRA_PASSWORD = 16
# With a keyspace per namespace, the installation keyspace prefixes the namespaces' (casque.tenancy).
MAX_ISOLATED_KEYSPACE = 24

Consistency = Literal["ONE", "LOCAL_ONE", "QUORUM", "LOCAL_QUORUM", "EACH_QUORUM", "ALL"]
# `none`: every namespace's tables in the installation keyspace, one Cassandra role for all.
# `keyspace`: a keyspace and a role per namespace (casque.tenancy).
CassandraIsolation = Literal["none", "keyspace"]


class ReplicationSettings(BaseSettings):
    """The installation keyspace's replication. SimpleStrategy with factor 1 is for the local stack only."""

    model_config = SettingsConfigDict(env_prefix="CASQUE_REPLICATION_")

    strategy: Literal["SimpleStrategy", "NetworkTopologyStrategy"] = "SimpleStrategy"
    factor: int = Field(default=1, ge=1, le=9)
    # NetworkTopologyStrategy: datacenter name -> replicas, e.g. CASQUE_REPLICATION_DATACENTERS='{"dc1": 3}'
    datacenters: dict[str, int] = Field(default_factory=dict)

    def cql_map(self) -> str:
        if self.strategy == "SimpleStrategy":
            return f"{{'class': 'SimpleStrategy', 'replication_factor': {self.factor}}}"
        if not self.datacenters:
            raise ValueError("NetworkTopologyStrategy needs at least one datacenter")
        dcs = ", ".join(f"'{dc}': {rf}" for dc, rf in sorted(self.datacenters.items()))
        return f"{{'class': 'NetworkTopologyStrategy', {dcs}}}"


class TlsSettings(BaseSettings):
    """TLS to one backend. Off by default. On, the server's certificate must chain to
    `ca_file` (or to the system's CAs without one) and, unless `verify_hostname` is turned
    off, name the host the client dialled. `cert_file` and `key_file` (PEM) are the client's
    own certificate, for servers that require one (mutual TLS)."""

    enabled: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    verify_hostname: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> TlsSettings:
        prefix = self.model_config.get("env_prefix", "")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(f"{prefix}CERT_FILE and {prefix}KEY_FILE go together")
        files = (self.ca_file, self.cert_file, self.key_file)
        if not self.enabled and any(f is not None for f in files):
            # Files without TLS would connect in plaintext while looking configured.
            raise ValueError(f"{prefix}CA_FILE, CERT_FILE and KEY_FILE need {prefix}ENABLED=true")
        return self


class CassandraTlsSettings(TlsSettings):
    model_config = SettingsConfigDict(env_prefix="CASQUE_CASSANDRA_TLS_")

    # The name every node's certificate carries (a Service's DNS name, say). Unset, the
    # driver checks each node's certificate against the address it connects to (contact
    # points and peers alike are IP addresses to the driver), so certificates need IP SANs.
    server_hostname: str | None = None


class ZooKeeperTlsSettings(TlsSettings):
    model_config = SettingsConfigDict(env_prefix="CASQUE_ZOOKEEPER_TLS_")


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting's error would otherwise repeat every input,
    # passwords included (a short password appeared whole in the message that refused it).
    model_config = SettingsConfigDict(env_prefix="CASQUE_", hide_input_in_errors=True)

    # Comma-separated in the environment: CASQUE_CASSANDRA_CONTACT_POINTS=10.0.0.1,10.0.0.2
    cassandra_contact_points: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["127.0.0.1"])
    cassandra_port: int = 9042
    cassandra_username: str | None = None
    # A secret: never in a log line, a repr or an error message.
    cassandra_password: SecretStr | None = None
    cassandra_local_dc: str | None = None
    # The operator's and the CLI's setting (they hold the installation's credentials and
    # reach every namespace). A sidecar never sets it: it is given its namespace's keyspace
    # as CASQUE_KEYSPACE and its namespace's role.
    cassandra_isolation: CassandraIsolation = "none"
    keyspace: str = Field(default="casque", pattern=r"^[a-z][a-z0-9_]{0,47}$")
    consistency: Consistency = "LOCAL_QUORUM"
    zookeeper_hosts: str = "127.0.0.1:2181"
    # Every znode of the installation lives under this path (see casque.znodes).
    zookeeper_root: str = Field(default="/casque", pattern=r"^(/[A-Za-z0-9_.-]+)+$")
    # The ZooKeeper session timeout asked for. The server clamps it to its minSessionTimeout
    # and maxSessionTimeout (2..20 ticks by default), and leases are trusted for what it
    # granted (a warning at connect says when that is less). A member paused longer than
    # this loses its leases to the others; shorter moves shards sooner after a crash, longer
    # rides out longer GC pauses.
    zookeeper_session_timeout_seconds: Annotated[float, Field(ge=1, le=120)] = 10.0
    # Digest authentication to ZooKeeper (casque.backends.zkacl). Unset: no authentication,
    # and znodes are created open to anyone, as before ACLs existed. The operator's settings
    # name the installation identity; a sidecar's, its namespace's (from the Secret the
    # operator writes into the namespace).
    zookeeper_username: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]+$")] = None
    zookeeper_password: SecretStr | None = None
    # While rotating the installation password: the old one, so the operator can still
    # reach znodes whose ACLs name it, and every ACL it writes names both.
    zookeeper_previous_password: SecretStr | None = None
    # A sidecar's only: the ACL of everything it creates, `scheme:id:perms,...` (the operator
    # writes it into the namespace's Secret next to the credentials).
    zookeeper_acl: str | None = None
    # The installation identity's only (operator, CLI): log in over SASL DIGEST-MD5 with the
    # username and password above, a user of the servers' JAAS `Server` section, instead of
    # digest; its ACL entries are then `sasl:<username>`. Namespaces' identities stay digest.
    zookeeper_sasl: bool = False
    # The installation's (operator): the ensemble is the installation's own (the chart's
    # embedded one, the local stack), so the operator closes `/` and `/zookeeper` to every
    # other login (casque.backends.ensemble_acl). Not on an ensemble other applications share.
    zookeeper_owned_ensemble: bool = False
    # The installation's (operator, CLI) with keyspace isolation or ZooKeeper credentials: the
    # random key every namespace's Cassandra role password and ZooKeeper identity password are
    # derived from (casque.derivation). Never a login password, so a namespace's Secrets tell
    # nothing about any; changing it rotates every namespace's passwords.
    derivation_key: SecretStr | None = None
    # While rotating it: the previous key. The ZooKeeper identities derived from it stay in
    # the ACLs the operator writes, so sidecars still holding them keep working until they
    # restart. (Cassandra keeps one password per role: its rotation has no overlap.)
    previous_derivation_key: SecretStr | None = None
    replication: ReplicationSettings = Field(default_factory=ReplicationSettings)
    cassandra_tls: CassandraTlsSettings = Field(default_factory=CassandraTlsSettings)
    zookeeper_tls: ZooKeeperTlsSettings = Field(default_factory=ZooKeeperTlsSettings)

    @model_validator(mode="after")
    def _zookeeper_credentials_paired(self) -> Settings:
        if (self.zookeeper_username is None) != (self.zookeeper_password is None):
            raise ValueError("CASQUE_ZOOKEEPER_USERNAME and CASQUE_ZOOKEEPER_PASSWORD go together")
        if self.zookeeper_previous_password is not None and self.zookeeper_password is None:
            raise ValueError("CASQUE_ZOOKEEPER_PREVIOUS_PASSWORD needs CASQUE_ZOOKEEPER_PASSWORD")
        if self.zookeeper_sasl and self.zookeeper_password is None:
            raise ValueError("CASQUE_ZOOKEEPER_SASL=true needs CASQUE_ZOOKEEPER_USERNAME and _PASSWORD "
                             "(the SASL DIGEST-MD5 user of the ZooKeeper servers' JAAS file)")
        if self.zookeeper_sasl and self.zookeeper_acl is not None:
            # A namespace's credentials (those come with an ACL) are digest: the servers' JAAS
            # file knows the installation's user only.
            raise ValueError("CASQUE_ZOOKEEPER_SASL is for the installation identity; a namespace's "
                             "credentials (with CASQUE_ZOOKEEPER_ACL) log in with digest: unset CASQUE_ZOOKEEPER_SASL")
        for name, secret in (("PASSWORD", self.zookeeper_password), ("PREVIOUS_PASSWORD", self.zookeeper_previous_password)):
            # The SHA-1 digest of user:password is in every ACL (and so in every namespace's
            # Secret): only a long random password keeps it from being guessed offline.
            if secret is not None and len(secret.get_secret_value()) < MIN_ZOOKEEPER_PASSWORD:
                raise ValueError(f"CASQUE_ZOOKEEPER_{name} must be at least {MIN_ZOOKEEPER_PASSWORD} characters")
        cassandra_password = self.cassandra_password
        if cassandra_password is not None and len(cassandra_password.get_secret_value()) < MIN_CASSANDRA_PASSWORD:
            raise ValueError(f"CASQUE_CASSANDRA_PASSWORD must be at least {MIN_CASSANDRA_PASSWORD} characters "
                             "(e.g. `openssl rand -base64 24`)")
        if self.cassandra_isolation == "keyspace" and self.cassandra_password is None:
            # The operator creates the namespaces' keyspaces and roles with it.
            raise ValueError("CASQUE_CASSANDRA_ISOLATION=keyspace needs CASQUE_CASSANDRA_USERNAME and _PASSWORD")
        if self.derivation_key is None:
            # A sidecar's settings name a namespace's identity and come with its ACL: only the
            # installation's derive the namespaces' passwords.
            if self.cassandra_isolation == "keyspace":
                raise ValueError("CASQUE_CASSANDRA_ISOLATION=keyspace needs CASQUE_DERIVATION_KEY, a random key of "
                                 f"at least {MIN_DERIVATION_KEY} bytes (e.g. `openssl rand -base64 32`) that each "
                                 "namespace's role password is derived from")
            if self.zookeeper_password is not None and self.zookeeper_acl is None:
                raise ValueError("the installation's ZooKeeper credentials (CASQUE_ZOOKEEPER_USERNAME without "
                                 "CASQUE_ZOOKEEPER_ACL) need CASQUE_DERIVATION_KEY, a random key of at least "
                                 f"{MIN_DERIVATION_KEY} bytes "
                                 "(e.g. `openssl rand -base64 32`) that each namespace's identity is derived from")
            if self.previous_derivation_key is not None:
                raise ValueError("CASQUE_PREVIOUS_DERIVATION_KEY needs CASQUE_DERIVATION_KEY")
        for setting, key in (("CASQUE_DERIVATION_KEY", self.derivation_key),
                             ("CASQUE_PREVIOUS_DERIVATION_KEY", self.previous_derivation_key)):
            # Every namespace's passwords are HMACs keyed with it, and each namespace holds its
            # own in its Secrets: a short key could be found by guessing offline.
            if key is not None:
                check_key(key.get_secret_value(), setting)
        if self.cassandra_isolation == "keyspace" and len(self.keyspace) > MAX_ISOLATED_KEYSPACE:
            # It prefixes every namespace's keyspace, which Cassandra limits to 48 characters.
            raise ValueError(f"CASQUE_KEYSPACE must be at most {MAX_ISOLATED_KEYSPACE} characters "
                             "with CASQUE_CASSANDRA_ISOLATION=keyspace")
        return self

    def derivation_keys(self) -> list[str]:
        """The derivation keys the namespaces' identities come from: the current one first,
        then, while it is being rotated, the previous one. None without a key."""
        keys = (self.derivation_key, self.previous_derivation_key)
        return [key.get_secret_value() for key in keys if key is not None]

    @field_validator("cassandra_contact_points", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str) and not value.startswith("["):
            return [host.strip() for host in value.split(",") if host.strip()]
        return value
