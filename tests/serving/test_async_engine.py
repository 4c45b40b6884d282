"""The engine behind asyncio callers (what the server stands on): on a thread of this
process, and in a process of its own that dies and is replaced."""

import asyncio
import os
import signal
import time

import pytest

from specdec import LLM, SamplingParams
from specdec.errors import RequestError
from specdec.serving.async_engine import AsyncEngine, EngineUnavailable


def test_requests_cancelled_while_being_added_leave_the_engine_serving(smol):
    """A caller cancelled while the engine adds its request (a client gone at once) must
    neither stop the engine nor leave the request running for nobody."""
    engine = AsyncEngine.start_thread(smol)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ids = smol.encode("Name a color.")

    async def scenario():
        for attempt in range(30):
            task = asyncio.create_task(anext(engine.generate(ids, params)))
            for _ in range(attempt % 3):  # cancel at different points of the add
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        async for _handle, update in engine.generate(ids, params):
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


def test_a_request_that_finishes_before_its_caller_reads_keeps_its_updates(smol):
    """The engine may finish a one-token request and deliver its last update before the
    caller starts reading: the caller still reads its token and a clean finish, not an
    error (a server answered 500 to such requests)."""
    engine = AsyncEngine.start_thread(smol)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def scenario():
        (handle,) = await engine.submit([(smol.encode("Name a color."), params)])
        deadline = time.monotonic() + 30
        while smol.engine.has_unfinished() and time.monotonic() < deadline:  # added by the time submit answers
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the reader thread has delivered the last update
        return [update async for update in engine.updates(handle)]

    try:
        updates = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert updates[-1].finished and updates[-1].error is None and updates[-1].num_output_tokens == 1
        assert sum(len(u.new_token_ids) for u in updates) == 1
    finally:
        engine.shutdown()


def test_a_bad_request_among_several_queues_none(smol):
    engine = AsyncEngine.start_thread(smol)
    good = (smol.encode("Hi"), SamplingParams(max_tokens=2))

    async def scenario():
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await engine.submit([good, ([10**7], SamplingParams(max_tokens=2))])
        return await engine.call("stats")

    try:
        stats = asyncio.run(scenario())
        assert stats["running_requests"] == stats["queue_depth"] == 0 and not smol.engine.requests
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_an_engine_process_killed_mid_request_is_replaced(tmp_path):
    """The engine in its own process: its output equals the library's; SIGKILL mid-request
    ends that request with an error naming the signal, new requests are refused as
    unavailable while a new process loads, and then answered as before."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(dtype="float32", engine={"compile": False})
    config = llm.config
    ids = llm.encode("Name three primary colors.")
    expected = llm.generate({"prompt_token_ids": ids}, params)[0].text
    engine = AsyncEngine.start_process(config)

    async def answer():
        async for _handle, update in engine.generate(ids, params):
            last = update
        return last.text

    async def killed_mid_request():
        long = SamplingParams(max_tokens=4000, min_tokens=4000, temperature=0.0)
        async for _handle, update in engine.generate(ids, long):
            if update.num_output_tokens and engine._process.is_alive():
                os.kill(engine._process.pid, signal.SIGKILL)
            last = update
        return last

    try:
        assert engine.info.resolved["compile"] is False and asyncio.run(answer()) == expected
        last = asyncio.run(killed_mid_request())
        assert last.finished and "SIGKILL" in last.error
        refused = None
        deadline = time.monotonic() + 300
        while engine.unavailable is not None:
            try:
                asyncio.run(answer())
            except EngineUnavailable as exc:
                refused = exc
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert refused is None or "restarting" in str(refused)
        assert engine.restarts == 1 and asyncio.run(answer()) == expected
    finally:
        engine.shutdown()
