"""The durable queue, in process: entries survive a restart, are drained and removed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tierckpt.errors import TierError
from tierckptd.knobs import KNOBS
from tierckptd.persistent import DrainQueue, manifest_key
from tierckptd.persistent.queue import QueueWriter

from .rig import URL, Rig, until


def test_queue_resumes_after_a_restart_drains_and_removes_entries(tmp_path: Path) -> None:
    async def body() -> None:
        first = Rig(tmp_path)
        first.faulty.fail("put_bytes", times=100, retryable=False, where="/content/")  # refused: entries stay
        await first.tier.start()
        with KNOBS.overridden(failed_retry_seconds=3600.0):
            for rank in (0, 1):
                first.save("job", 5, rank, {"a": b"A%d" % rank, "b": b"B" * 100}, world=2)
            await until(lambda: all(e.error for e in first.tier.ledger.pending.values())
                        and len(first.tier.ledger.pending) == 2, "both attempts to fail")
            with pytest.raises(TierError, match="AccessDenied"):
                await first.tier.wait("job", 5, 0, None)
            await first.tier.stop(1.0)
        assert first.queue_files() == ["job.00000000000000000005.0000000.json",
                                       "job.00000000000000000005.0000001.json"]
        assert [k for k in first.memory.objects if "/manifests/" in k or "/leases/" in k] == []  # leases released
        # An entry whose rank left the local tier meanwhile is abandoned at start.
        gone = {"format": 1, "job": "job", "step": 9, "rank": 0, "generation": "g", "enqueued": 1.0}
        (first.tier.queue.root / "job.00000000000000000009.0000000.json").write_text(json.dumps(gone))

        second = Rig(tmp_path, store=first.store, memory=first.memory)  # the daemon restarts
        await second.tier.start()
        assert await asyncio.wait_for(second.tier.wait("job", 5, 1, None), 10) == [URL]
        assert await asyncio.wait_for(second.tier.wait("job", 5, 0, None), 10) == [URL]
        with pytest.raises(TierError, match="left the local tier before it was drained"):
            await second.tier.wait("job", 9, 0, None)
        await second.tier.writer.flush()
        assert second.queue_files() == []
        assert second.memory.list("job/manifests/") == [manifest_key("job", 5, r, 2) for r in (0, 1)]
        assert second.tier.status()["backlog_steps"] == 0
        await second.tier.stop(1.0)

    asyncio.run(body())


def test_queue_writer_applies_changes_in_call_order(tmp_path: Path) -> None:
    """A remove of a drained save never overtakes the put of the re-save queued after it."""
    async def body() -> None:
        rig = Rig(tmp_path)
        man = rig.save("job", 1, 0, {"a": b"1"})  # the tier is not started: nothing drains
        writer = QueueWriter(DrainQueue(tmp_path / "q", fsync=False))
        (tmp_path / "q").mkdir()
        writer.put(man, 1.0)
        writer.remove("job", 1, 0)
        writer.put(man, 2.0)
        await writer.flush()
        assert [d["enqueued"] for d in writer.queue.load()] == [2.0]

    asyncio.run(body())
