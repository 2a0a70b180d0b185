"""Servers that run beside the operator on every replica, leader or standby: the
sidecar-injection webhook and the External Metrics API. Whichever ends first, the operator or
a server, ends them all: a replica that cannot serve is restarted rather than left half-up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping


async def run_beside(operator: Awaitable[int], servers: Mapping[str, Awaitable[None]]) -> int:
    """The operator's exit code; raises if a server stopped first (a bad certificate, a taken
    port), naming it."""
    running = asyncio.ensure_future(operator)
    serving = {name: asyncio.ensure_future(server) for name, server in servers.items()}
    try:
        await asyncio.wait({running, *serving.values()}, return_when=asyncio.FIRST_COMPLETED)
        if running.done():
            return running.result()
        for name, task in serving.items():
            if task.done():
                task.result()  # its error, if it failed
                raise RuntimeError(f"the {name} server stopped")
        raise AssertionError("asyncio.wait returned with nothing done")
    finally:
        running.cancel()
        for task in serving.values():
            task.cancel()
        await asyncio.gather(running, *serving.values(), return_exceptions=True)
