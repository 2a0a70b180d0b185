"""CassandraReach (casque.engine.reachability): the verdicts a member steps back and rejoins on."""

from __future__ import annotations

import asyncio

from casque.engine.reachability import CassandraReach
from casque.errors import BackendUnavailable


class Backend:
    """A probe target that answers, fails, or hangs (a blackholed link) as the test says."""

    def __init__(self) -> None:
        self.mode = "up"
        self.released = asyncio.Event()

    async def probe(self) -> None:
        if self.mode == "down":
            raise BackendUnavailable("Cassandra: NoHostAvailable")
        if self.mode == "silent":
            await self.released.wait()


async def _verdicts(backend: Backend, steps: list[str]) -> list[bool]:
    """Switch the backend through `steps`, awaiting a verdict after each; the verdicts."""
    verdicts: asyncio.Queue[bool] = asyncio.Queue()
    reach = CassandraReach(backend.probe, lambda: 0.5, verdicts.put_nowait)
    reach.start()
    seen = []
    try:
        for mode in steps:
            backend.mode = mode
            if mode == "up":
                backend.released.set()
            seen.append(await asyncio.wait_for(verdicts.get(), 30))
            if not seen[-1]:
                assert reach.problem.startswith("Cassandra unreachable for"), reach.problem
            else:
                assert reach.problem == ""
    finally:
        await reach.stop()
    return seen


async def test_failing_probes_make_it_unreachable_and_an_answer_reachable_again() -> None:
    assert await _verdicts(Backend(), ["down", "up"]) == [False, True]


async def test_a_probe_that_never_answers_counts_as_unanswered() -> None:
    # A blackhole: the probe neither fails nor returns; the verdict comes on time alone.
    assert await _verdicts(Backend(), ["silent", "up"]) == [False, True]


async def test_the_reason_names_the_last_error() -> None:
    backend = Backend()
    backend.mode = "down"
    lost = asyncio.Event()
    reach = CassandraReach(backend.probe, lambda: 0.5, lambda reachable: lost.set())
    reach.start()
    try:
        await asyncio.wait_for(lost.wait(), 30)
        assert "NoHostAvailable" in reach.problem
    finally:
        await reach.stop()
