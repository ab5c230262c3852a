"""run_owning: what a cancelled RPC acquired in a worker thread is released, not leaked."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tierckptd.offload import run_owning


def test_a_cancelled_caller_hands_the_result_to_undo() -> None:
    started, finish = threading.Event(), threading.Event()
    undone: list[str] = []
    released = threading.Event()

    def acquire() -> str:
        started.set()
        finish.wait(60)
        return "staging-1"

    def undo(x: str) -> None:
        undone.append(x)
        released.set()

    async def main() -> None:
        task = asyncio.create_task(run_owning(acquire, undo))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)
        task.cancel()  # the RPC's caller went away while the thread still runs
        with pytest.raises(asyncio.CancelledError):
            await task
        assert undone == []  # not before the thread has a result
        finish.set()
        assert await asyncio.get_running_loop().run_in_executor(None, released.wait, 60)

    asyncio.run(main())
    assert undone == ["staging-1"]


def test_a_completed_call_returns_and_keeps_its_result() -> None:
    undone: list[int] = []

    async def main() -> int:
        return await run_owning(lambda: 7, undone.append)

    assert asyncio.run(main()) == 7
    assert undone == []


def test_a_failed_call_has_nothing_to_undo() -> None:
    undone: list[int] = []

    def boom() -> int:
        raise OSError("disk gone")

    async def main() -> None:
        with pytest.raises(OSError, match="disk gone"):
            await run_owning(boom, undone.append)

    asyncio.run(main())
    assert undone == []
