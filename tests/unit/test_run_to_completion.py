"""`run_to_completion`: ARC-Top-K's async all-reduce steps run in the round thread without an event loop."""

from __future__ import annotations

import asyncio

import pytest

from moshpeer.averaging.group_dataplane import run_to_completion


def test_a_coroutine_that_never_suspends_returns_its_value():
    calls = []

    async def dense_allreduce(x: int) -> int:  # what GroupDataPlane passes: blocking work behind `async def`
        calls.append(x)
        return x + 1

    async def two_allreduces(x: int) -> int:  # the shape of ArcTopK.allreduce_selected: sketch, then rows
        return await dense_allreduce(await dense_allreduce(x))

    assert run_to_completion(two_allreduces(1)) == 3 and calls == [1, 2]


def test_a_coroutine_that_suspends_is_an_error_not_a_hang():
    async def needs_a_loop() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="suspended"):
        run_to_completion(needs_a_loop())
