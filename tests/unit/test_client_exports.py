"""The client package's public names: each one resolves from its module at first use, and a
process that takes only `casque_client.loopback` (the sidecar) loads none of the client."""

from __future__ import annotations

import json
import subprocess
import sys

import casque_client


def test_every_public_name_resolves_and_none_is_missing() -> None:
    assert set(casque_client.__all__) == set(casque_client._HOMES)
    for name in casque_client.__all__:
        value = getattr(casque_client, name)
        assert getattr(sys.modules[casque_client._HOMES[name]], name) is value
    assert set(casque_client.__all__) <= set(dir(casque_client))


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        casque_client.Publisher  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert "Publisher" in str(error)
    else:
        raise AssertionError("an unknown name resolved")


def test_the_loopback_check_loads_none_of_the_client() -> None:
    probe = ("import json, sys; from casque_client.loopback import is_loopback; "
             "assert is_loopback('127.0.0.1'); "
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('casque_client', 'aiohttp')))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                       check=True).stdout)
    assert loaded == ["casque_client", "casque_client.loopback"]
