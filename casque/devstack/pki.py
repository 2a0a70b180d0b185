"""Test certificates for the local servers: a CA, certificates it signs, and Java key stores
(which the Spark jobs make from PEM files too: the Cassandra connector reads no PEM).

Made with the `openssl` command line tool (and the JDK's `keytool` for Java trust stores),
so nothing beyond what the local stack needs already is required. The keys are P-256 and
live for a year: they are for a stack on this machine, never for a real installation.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from casque.errors import StackError


def openssl(*args: str, cwd: Path) -> None:
    _run("openssl", *args, cwd=cwd)


def _run(tool: str, *args: str, cwd: Path) -> None:
    exe = shutil.which(tool)
    if exe is None:
        raise StackError(f"the `{tool}` command is needed to make test certificates")
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise StackError(f"{tool} {' '.join(args)} failed:\n{proc.stderr or proc.stdout}")


def make_ca(pki: Path, name: str = "casque-test-ca") -> tuple[Path, Path]:
    """A self-signed CA in `pki`: (certificate, key)."""
    pki.mkdir(parents=True, exist_ok=True)
    crt, key = pki / "ca.crt", pki / "ca.key"
    _run(
        "openssl", "req", "-x509", "-new", "-nodes",
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", key.name, "-out", crt.name,
        "-days", "365", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=pki,
    )
    key.chmod(0o600)
    return crt, key


def issue_cert(
    pki: Path, ca_crt: Path, ca_key: Path, name: str, hosts: Sequence[str] = (), *, client: bool = False
) -> tuple[Path, Path]:
    """Sign a certificate `name` with the CA: for serving `hosts` (DNS names and/or IPs,
    in its subjectAltName) and talking to the server's peers, or with `client`, for a client
    to present (mutual TLS)."""
    crt, key, csr, ext = (pki / f"{name}{s}" for s in (".crt", ".key", ".csr", ".ext"))
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature",
        # A server's certificate is also what it presents to its peers (Cassandra's internode
        # and ZooKeeper's quorum TLS check each other as clients).
        f"extendedKeyUsage={'clientAuth' if client else 'serverAuth,clientAuth'}",
        "subjectKeyIdentifier=hash",
        "authorityKeyIdentifier=keyid",
    ]
    if hosts:
        lines.append("subjectAltName=" + ",".join(f"IP:{h}" if is_ip(h) else f"DNS:{h}" for h in dict.fromkeys(hosts)))
    ext.write_text("\n".join(lines) + "\n")
    _run(
        "openssl", "req", "-new", "-nodes",
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", key.name, "-out", csr.name, "-subj", f"/CN={name}",
        cwd=pki,
    )
    _run(
        "openssl", "x509", "-req", "-in", csr.name, "-CA", str(ca_crt), "-CAkey", str(ca_key),
        "-set_serial", str(secrets.randbits(63)), "-days", "365",
        "-extfile", ext.name, "-out", crt.name,
        cwd=pki,
    )
    csr.unlink()
    ext.unlink()
    key.chmod(0o600)
    return crt, key


def is_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return True
    return False


@dataclass(frozen=True)
class JavaStores:
    """A PKCS12 key store (a server's key and certificate) and a PKCS12 trust store (the CA),
    both under `password`: what Cassandra and ZooKeeper read."""

    keystore: Path
    truststore: Path
    password: str


def pkcs12_keystore(crt: Path, key: Path, path: Path, password: str, alias: str = "casque") -> Path:
    """A PKCS12 key store at `path` with a PEM certificate and its key."""
    path.unlink(missing_ok=True)
    _run("openssl", "pkcs12", "-export", "-in", str(crt), "-inkey", str(key), "-name", alias,
         "-out", str(path), "-passout", f"pass:{password}", cwd=path.parent)
    path.chmod(0o600)
    return path


def pkcs12_truststore(ca_crt: Path, path: Path, password: str) -> Path:
    """A PKCS12 trust store at `path` with the PEM CA certificate(s) of `ca_crt`."""
    path.unlink(missing_ok=True)
    # openssl's PKCS12 files carry no mark that Java takes for a trusted certificate (before
    # OpenSSL 3.2's -jdktrust), so the trust store comes from the JDK's keytool.
    _run("keytool", "-importcert", "-noprompt", "-alias", "casque-ca", "-file", str(ca_crt),
         "-keystore", str(path), "-storetype", "PKCS12", "-storepass", password, cwd=path.parent)
    path.chmod(0o600)
    return path


def java_stores(pki: Path, ca_crt: Path, crt: Path, key: Path, name: str) -> JavaStores:
    password = secrets.token_hex(16)
    return JavaStores(pkcs12_keystore(crt, key, pki / f"{name}-keystore.p12", password, name),
                      pkcs12_truststore(ca_crt, pki / f"{name}-truststore.p12", password), password)


@dataclass(frozen=True)
class LocalPki:
    """The certificates of a local stack, in one directory, made once and reused by every
    later `up` of the stack: a CA, one serving certificate for every server of the stack
    (they all listen on loopback addresses), a client certificate for mutual TLS, and the
    servers' Java stores."""

    directory: Path

    @property
    def ca_crt(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def server_crt(self) -> Path:
        return self.directory / "server.crt"

    @property
    def client_crt(self) -> Path:
        return self.directory / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.directory / "client.key"

    @property
    def stores(self) -> JavaStores:
        return JavaStores(self.directory / "server-keystore.p12", self.directory / "server-truststore.p12",
                          self.password_file.read_text().strip())

    @property
    def password_file(self) -> Path:
        """The Java stores' password, in a file: ZooKeeper reads it from there, and nothing
        puts it on a command line."""
        return self.directory / "store-password"

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts the stack's CA and presents its client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_crt))
        context.load_cert_chain(str(self.client_crt), str(self.client_key))
        return context

    def ensure(self, hosts: Sequence[str]) -> None:
        """Make whatever is missing; the server certificate names `hosts` and localhost."""
        if self.password_file.exists():
            return
        ca_crt, ca_key = make_ca(self.directory, "casque-dev-ca")
        crt, key = issue_cert(self.directory, ca_crt, ca_key, "server", [*hosts, "localhost"])
        issue_cert(self.directory, ca_crt, ca_key, "client", client=True)
        stores = java_stores(self.directory, ca_crt, crt, key, "server")
        # Written last: its presence says the directory is complete.
        self.password_file.write_text(stores.password + "\n")
        self.password_file.chmod(0o600)
