"""Failures, in process: an outage is ridden out, a refusal is reported and retried later, a
corrupt download is never returned."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tierckpt.errors import DataLossError, TierError
from tierckptd.knobs import KNOBS
from tierckptd.retry import RetryPolicy

from .rig import URL, Rig, until

FAST = RetryPolicy(initial_delay=0.01, max_delay=0.02, deadline=None, jitter=False)


def test_an_outage_delays_the_drain_and_loses_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        rig = Rig(tmp_path)
        rig.faulty.fail("put_bytes", times=5, retryable=True, where="/content/")
        rig.faulty.fail("put_bytes", times=3, retryable=True, where="/manifests/")
        with KNOBS.overridden(drain_retry=FAST):
            await rig.tier.start()
            rig.save("job", 1, 0, {"a": b"a" * 100})
            assert await asyncio.wait_for(rig.tier.wait("job", 1, 0, None), 10) == [URL]
        assert rig.faulty.calls["put_bytes"] == 1 + 6 + 4  # the lease, the one chunk, the manifest
        assert rig.memory.list("job/leases/") == []
        assert rig.tier.status()["backlog_steps"] == 0
        await rig.tier.stop(1.0)

    asyncio.run(body())


def test_a_refusal_is_reported_and_the_rank_is_tried_again_later(tmp_path: Path) -> None:
    async def body() -> None:
        rig = Rig(tmp_path)
        rig.faulty.fail("put_bytes", times=1, retryable=False, where="/content/")
        with KNOBS.overridden(failed_retry_seconds=0.05):
            await rig.tier.start()
            rig.save("job", 1, 0, {"a": b"a"})
            await until(lambda: rig.tier.status()["failing"] == 1 or not rig.tier.ledger.pending, "the refusal")
            if rig.tier.ledger.pending:  # not retried yet: wait reports the error
                with pytest.raises(TierError, match="AccessDenied.*tried again every"):
                    await rig.tier.wait("job", 1, 0, None)
            await until(lambda: not rig.tier.ledger.pending, "the second attempt")
            assert await rig.tier.wait("job", 1, 0, None) == [URL]
        await rig.tier.stop(1.0)

    asyncio.run(body())


def test_a_corrupt_download_is_discarded_and_a_good_one_restored(tmp_path: Path) -> None:
    async def body() -> None:
        writer = Rig(tmp_path, node_id="a")
        await writer.tier.start()
        writer.save("job", 3, 0, {"model": bytes(range(256)) * 4, "optim": b"o" * 7})
        await asyncio.wait_for(writer.tier.wait("job", 3, 0, None), 10)
        await writer.tier.stop(1.0)

        reader = Rig(tmp_path, node_id="b", memory=writer.memory)  # a brand-new node
        await reader.tier.start()
        reader.faulty.corrupt_reads("get_bytes", where="/content/")  # the chunks, not the manifest
        with pytest.raises(DataLossError, match="failed verification"):
            await reader.tier.fetch("job", 3, 0)
        assert reader.store.get("job", 3, 0) is None and reader.store.open_saves() == 0
        reader.faulty.corrupt_reads("none")
        local = await reader.tier.fetch("job", 3, 0)
        assert local.node == "a" and reader.host.ingested == [local]
        assert reader.store.shard_path(local, "model").read_bytes() == bytes(range(256)) * 4
        assert reader.tier.status()["backlog_steps"] == 0  # a downloaded copy is not drained again
        await reader.tier.stop(1.0)

    asyncio.run(body())


def test_a_probe_cut_between_its_put_and_its_delete_leaves_nothing_behind(tmp_path: Path) -> None:
    """The store fails after the probe's put: the probe fails (the tier shows degraded), and its
    object is deleted with the next probe's once the store works again."""
    from tierckptd.backends.base import BackendError

    async def body() -> None:
        rig = Rig(tmp_path)
        rig.faulty.fail("delete", times=2, where=".tierckpt-probe/")
        for _ in range(2):
            with pytest.raises(BackendError, match="injected"):
                await rig.tier.probe()
        assert len(rig.memory.list(".tierckpt-probe/")) == 2  # each put landed, neither delete
        await rig.tier.probe()
        assert rig.memory.list(".tierckpt-probe/") == []
        await rig.tier.stop(1.0)

    asyncio.run(body())


def test_a_probe_beside_a_slow_one_keeps_the_objects_it_could_not_delete(tmp_path: Path) -> None:
    """A probe's delete that fails while an earlier probe's delete is still running (a probe that
    timed out leaves its thread behind) stays listed, and the next probe deletes it."""
    from tierckptd.backends.base import BackendError

    async def body() -> None:
        rig = Rig(tmp_path)
        rig.faulty.fail("delete", times=1, where=".tierckpt-probe/")
        with pytest.raises(BackendError, match="injected"):
            await rig.tier.probe()  # A: its object is left for the next probe
        rig.faulty.hang("delete")
        slow = asyncio.ensure_future(rig.tier.probe())  # B: deleting its own and A's, held
        assert await asyncio.to_thread(rig.faulty.wait_held, "delete")
        rig.faulty.fail("delete", times=1, where=".tierckpt-probe/")
        with pytest.raises(BackendError, match="injected"):
            await rig.tier.probe()  # C, beside B: its delete fails at once
        rig.faulty.release("delete")
        await slow
        assert len(rig.memory.list(".tierckpt-probe/")) == 1  # C's object, still to be deleted
        await rig.tier.probe()
        assert rig.memory.list(".tierckpt-probe/") == []
        await rig.tier.stop(1.0)

    asyncio.run(body())
