"""Handing a driver thread's result to the event loop that waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def call_soon_unless_closed(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    """`loop.call_soon_threadsafe(callback, *args)`, or nothing once `loop` is closed: a reply
    that comes while the process stops (its request still in flight) has nobody left to wait
    for it, and the driver would log the loop's refusal as an error of its own."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
