"""A driver thread's reply for a loop that has closed is dropped, not raised into the driver
(which logs it as an error of its own while the process stops)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from casque.backends.loop_handoff import call_soon_unless_closed


def test_a_reply_reaches_a_running_loop_from_another_thread() -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str] = loop.create_future()
        threading.Thread(target=call_soon_unless_closed, args=(loop, done.set_result, "row")).start()
        return await done

    assert asyncio.run(main()) == "row"


def test_a_reply_for_a_closed_loop_is_dropped() -> None:
    loop = asyncio.new_event_loop()
    called: list[str] = []
    loop.close()
    with pytest.raises(RuntimeError):
        loop.call_soon_threadsafe(called.append, "late")  # what the driver's thread met before
    call_soon_unless_closed(loop, called.append, "late")
    assert called == []
