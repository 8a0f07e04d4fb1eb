"""The end of the averager's event loop (loop_thread.py): what it leaves open is closed without an error in the log."""

from __future__ import annotations

import asyncio
import logging

from moshpeer.averaging.loop_thread import finish_pending_tasks


def test_a_chain_of_generators_left_open_closes_without_an_error(caplog):
    """A leader stopped while it answered a join request left its chain of generators suspended (each closes the next
    in its `finally`); closed all at once, an inner one was already being closed, and asyncio logged
    "aclose(): asynchronous generator is already running" as an ERROR."""
    closed = []

    async def inner():
        try:
            while True:
                yield 1
        finally:
            await asyncio.sleep(0)  # cleanup that awaits, as hivemind's does
            closed.append("inner")

    async def outer(source):
        try:
            async for item in source:
                yield item
        finally:
            await source.aclose()
            closed.append("outer")

    held = []  # as hivemind's stream handler holds them: no finalizer closes them early
    answering = asyncio.Event()

    async def serve():
        source = inner()
        answers = outer(source)
        held.extend([source, answers])
        async for _ in answers:
            answering.set()
            await asyncio.Event().wait()  # cancelled here, the generators suspended at their yields

    loop = asyncio.new_event_loop()
    try:
        loop.create_task(serve())
        loop.run_until_complete(asyncio.wait_for(answering.wait(), timeout=5))
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            finish_pending_tasks(loop)
    finally:
        loop.close()
    assert sorted(closed) == ["inner", "outer"]
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR], caplog.text
