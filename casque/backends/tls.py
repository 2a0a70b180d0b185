"""Client TLS contexts for the backends, from `TlsSettings`, and what a failed handshake means.

Both drivers hide a refused handshake: the Cassandra driver inside `NoHostAvailable`, kazoo
by retrying until its start times out. `probe` repeats one handshake with the same context
so the error can say why (an unknown CA, a name mismatch, a missing client certificate)
instead of "unreachable".
"""

from __future__ import annotations

import socket
import ssl

from casque.config import TlsSettings
from casque.errors import InvalidSettings


def client_context(tls: TlsSettings, name: str) -> ssl.SSLContext:
    """A client context: the server must present a certificate that chains to `tls.ca_file`
    (the system's CAs without one) and, with `verify_hostname`, names the dialled host."""
    try:
        context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = tls.verify_hostname
        if tls.cert_file is not None and tls.key_file is not None:
            context.load_cert_chain(certfile=str(tls.cert_file), keyfile=str(tls.key_file))
    except (OSError, ssl.SSLError) as error:
        # OSError's text names the missing file; the file itself never reaches a message.
        raise InvalidSettings(f"{name} TLS files ({_files(tls)}): {error}") from error
    return context


def _files(tls: TlsSettings) -> str:
    named = [f"{what} {path}" for what, path in (("CA", tls.ca_file), ("certificate", tls.cert_file),
                                                  ("key", tls.key_file)) if path is not None]
    return ", ".join(named) or "system CAs"


def probe(context: ssl.SSLContext, host: str, port: int, server_hostname: str | None = None,
          timeout: float = 5.0) -> str | None:
    """Why a TLS handshake with `host:port` fails with `context`; None if it succeeds, or if
    the server cannot be reached at all (then TLS is not the problem)."""
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    try:
        with context.wrap_socket(raw, server_hostname=server_hostname or host) as conn:
            # TLS 1.3 servers check the client's certificate after the handshake returns
            # here: their refusal arrives with the first read.
            conn.settimeout(0.5)
            try:
                conn.recv(1)
            except (TimeoutError, socket.timeout):
                pass
            except ssl.SSLError as error:
                return _reason(error)
        return None
    except ssl.SSLError as error:
        return _reason(error)
    except OSError as error:
        # A server that closes the connection at the first bytes of a handshake: it speaks
        # plaintext on this port, or refuses TLS from this client.
        return f"the handshake was cut off ({type(error).__name__}): the server does not speak TLS on this port"
    finally:
        raw.close()


def _reason(error: ssl.SSLError) -> str:
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"the server's certificate was not accepted: {error.verify_message}"
    reason = error.reason or str(error)
    if isinstance(error, ssl.SSLEOFError):
        # A plaintext server reads the handshake as a malformed request and hangs up.
        return f"the server closed the connection during the handshake ({reason}): it does not speak TLS on this port"
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"):
        return f"the server does not speak TLS on this port ({reason})"
    if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason or "BAD_CERTIFICATE" in reason:
        return f"the server refused this client ({reason}): it may require a client certificate signed by a CA it trusts"
    return f"TLS failed: {reason}"
