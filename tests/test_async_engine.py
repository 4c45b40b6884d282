"""The engine's thread and its asyncio callers (what the server stands on)."""

import asyncio
import time

from specdec import SamplingParams
from specdec.async_engine import AsyncEngine


def test_requests_cancelled_while_being_added_leave_the_engine_serving(smol):
    """A caller cancelled while the engine thread adds its request (a client gone at once)
    must neither kill that thread nor leave the request running for nobody."""
    engine = AsyncEngine(smol)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ids = smol.encode("Name a color.")

    async def scenario():
        for attempt in range(30):
            task = asyncio.create_task(anext(engine.generate(ids, params)))
            for _ in range(attempt % 3):  # cancel at different points of the add
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        async for _req, update in engine.generate(ids, params):
            last = update
        return last

    try:
        last = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert last.finished and last.num_output_tokens == 4 and last.error is None
        deadline = time.monotonic() + 30
        while smol.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not smol.engine.has_unfinished()
    finally:
        engine.shutdown()
