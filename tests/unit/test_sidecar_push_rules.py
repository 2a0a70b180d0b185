"""Which push URLs the sidecar accepts, and its push token."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from casque.sidecar.config import SidecarSettings, push_target
from casque.sidecar.push import push_token


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/events", "http://localhost/x", "https://[::1]:9/e",
                                 "http://127.3.4.5/e"])
def test_loopback_push_urls_are_accepted(url: str) -> None:
    assert push_target(url, allow_remote=False) == url
    assert SidecarSettings(push_url=url).push_url == url


@pytest.mark.parametrize("url", ["http://10.0.0.7/events", "http://app.default.svc/e", "http://localhost.evil.com/",
                                 "http://169.254.169.254/latest/meta-data"])
def test_other_push_urls_need_the_explicit_setting(url: str) -> None:
    with pytest.raises(ValueError, match="not on the pod's loopback"):
        push_target(url, allow_remote=False)
    with pytest.raises(ValidationError, match="PUSH_ALLOW_REMOTE"):
        SidecarSettings(push_url=url)
    assert SidecarSettings(push_url=url, push_allow_remote=True).push_url == url


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "127.0.0.1:80", "http:///path"])
def test_push_urls_must_be_http_with_a_host(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        push_target(url, allow_remote=True)


def test_the_push_token_is_configured_or_fresh_per_start() -> None:
    configured = SidecarSettings(push_token="t" * 32)
    assert push_token(configured) == "t" * 32
    generated = {push_token(SidecarSettings()) for _ in range(2)}
    assert len(generated) == 2 and all(len(token) >= 32 for token in generated)
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        SidecarSettings(push_token="short")
