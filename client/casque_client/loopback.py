"""Whether an address only the pod itself can reach: used by the client, and by the sidecar (which requires the client).

Only literal loopback addresses and the loopback's standard names count; a name that
resolves to 127.0.0.1 today may resolve elsewhere tomorrow.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """An address (or name) that only the pod itself can reach."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
