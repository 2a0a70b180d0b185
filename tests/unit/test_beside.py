"""casque.operator.beside: the operator and its servers end together."""

from __future__ import annotations

import asyncio

import pytest

from casque.operator.beside import run_beside


async def forever() -> None:
    await asyncio.Event().wait()


async def exits(code: int) -> int:
    return code


def test_the_operators_exit_code_ends_every_server() -> None:
    cancelled: list[str] = []

    async def server(name: str) -> None:
        try:
            await forever()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    code = asyncio.run(run_beside(exits(3), {"webhook": server("webhook"), "metrics": server("metrics")}))
    assert code == 3 and sorted(cancelled) == ["metrics", "webhook"]


def test_a_server_that_fails_ends_the_operator_and_says_why() -> None:
    stopped = asyncio.Event()

    async def operator() -> int:
        try:
            await forever()
        finally:
            stopped.set()
        return 0

    async def broken() -> None:
        raise OSError("address already in use")

    async def run() -> None:
        with pytest.raises(OSError, match="address already in use"):
            await run_beside(operator(), {"External Metrics API": broken()})
        assert stopped.is_set()

    asyncio.run(run())


def test_a_server_that_returns_is_named() -> None:
    async def returns() -> None:
        return None

    with pytest.raises(RuntimeError, match="the External Metrics API server stopped"):
        asyncio.run(run_beside(forever_code(), {"External Metrics API": returns()}))


async def forever_code() -> int:
    await forever()
    return 0
