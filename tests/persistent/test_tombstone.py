"""`tierckpt rm` is final against drains (persistent/tombstone.py), in process: a drain that
publishes after the deletion listed the step takes its manifest back, one that starts after it
publishes nothing, the catalog hides what a killed daemon left, and a save after `rm` drains."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import pytest
from tierckpt.errors import NotFoundError, TierError
from tierckptd.persistent.layout import tombstone_key
from tierckptd.persistent.tombstone import Tombstone

from .rig import Rig, until


def _manifests(rig: Rig, step: int) -> list[str]:
    return sorted(k for k in rig.memory.objects if f"/manifests/{step:020d}/rank-" in k)


def _data(rig: Rig, step: int) -> list[str]:
    return sorted(k for k in rig.memory.objects if f"/data/{step:020d}/" in k)


def test_a_manifest_put_in_flight_during_rm_is_taken_back(tmp_path: Path) -> None:
    async def body() -> None:
        a = Rig(tmp_path, node_id="a", layout="per-shard")
        man = a.save("job", 1, 0, {"w": b"w" * 3000})
        a.faulty.hang("put_bytes")  # the manifest's put (the per-shard layout streams the data)
        await a.tier.start()
        assert await asyncio.to_thread(a.faulty.wait_held, "put_bytes")  # past the first tombstone read
        b = Rig(tmp_path, node_id="b", memory=a.memory, layout="per-shard")
        await b.tier.start()
        deleted = await b.tier.delete("job", 1)  # lists no manifest: it is not there yet
        assert deleted.copies == 0 and tombstone_key("job", 1) in a.memory.objects
        a.faulty.release("put_bytes")
        with pytest.raises(TierError, match="deleted"):
            await asyncio.wait_for(a.tier.wait("job", 1, 0, None), 10)
        await until(lambda: not _manifests(a, 1) and not _data(a, 1), "the manifest and data taken back")
        assert not a.tier.ledger.pending and man.key not in a.tier.ledger.recent
        assert 1 not in await b.tier.catalog("job")
        await a.tier.stop(1.0)
        await b.tier.stop(1.0)
    asyncio.run(body())


def test_a_drain_queued_on_a_node_that_missed_rm_publishes_nothing_and_a_later_save_drains(tmp_path: Path) -> None:
    async def body() -> None:
        b = Rig(tmp_path, node_id="b", layout="per-shard")
        await b.tier.start()
        await b.tier.delete("job", 1)  # the step's other node was not reached
        a = Rig(tmp_path, node_id="a", memory=b.memory, layout="per-shard")
        first = a.save("job", 1, 0, {"w": b"w" * 3000})
        # the rig commits "now", after the deletion: name the save in the tombstone, as `rm` does
        # for the saves it learns of (the other rule, saves committed before it, is the same check)
        stone = Tombstone.parse("job", 1, b.memory.objects[tombstone_key("job", 1)])
        assert not stone.covers(first) and stone.covers(dataclasses.replace(first, created=stone.deleted_at))
        b.memory.objects[tombstone_key("job", 1)] = dataclasses.replace(
            stone, generations=frozenset({first.generation})).to_json()
        await a.tier.start()
        with pytest.raises(TierError, match="deleted"):
            await asyncio.wait_for(a.tier.wait("job", 1, 0, None), 10)
        await until(lambda: not _data(a, 1), "the uploaded data deleted")
        assert not _manifests(a, 1) and a.queue_files() == []
        assert a.faulty.calls["put_bytes"] == 0  # the manifest was never put (the first read refused it)
        # the job resumed from an earlier step and saved step 1 again: that save drains
        a.save("job", 1, 0, {"w": b"W" * 3000})
        assert await asyncio.wait_for(a.tier.wait("job", 1, 0, None), 10) == [a.tier.url]
        assert len(_manifests(a, 1)) == 1 and 1 in await b.tier.catalog("job")
        await a.tier.stop(1.0)
        await b.tier.stop(1.0)
    asyncio.run(body())


def test_the_catalog_hides_a_manifest_a_killed_drain_left_after_rm(tmp_path: Path) -> None:
    async def body() -> None:
        a = Rig(tmp_path, node_id="a")
        a.save("job", 1, 0, {"w": b"w" * 3000})
        a.save("job", 2, 0, {"w": b"v" * 3000})
        await a.tier.start()
        for step in (1, 2):
            await asyncio.wait_for(a.tier.wait("job", step, 0, None), 10)
        left = {k: v for k, v in a.memory.objects.items() if k in _manifests(a, 1)}
        await a.tier.delete("job", 1)
        assert not _manifests(a, 1)
        a.memory.objects.update(left)  # published, then killed before its second tombstone read
        await a.tier.stop(1.0)
        c = Rig(tmp_path, node_id="c", memory=a.memory)
        await c.tier.start()
        assert sorted(await c.tier.catalog("job")) == [2]
        with pytest.raises(NotFoundError, match="deleted"):
            await c.tier.fetch("job", 1, 0)
        assert c.store.get("job", 1, 0) is None
        await c.tier.stop(1.0)
    asyncio.run(body())


def test_rm_cancels_queued_drains_of_the_step_only(tmp_path: Path) -> None:
    async def body() -> None:
        a = Rig(tmp_path, node_id="a")
        a.faulty.hang("list")  # nothing drains until released
        a.save("job", 1, 0, {"w": b"w" * 3000})
        a.save("job", 2, 0, {"w": b"v" * 3000})
        await a.tier.start()
        gens, running = a.tier.drainer.cancel_step("job", 1)
        assert len(gens) == 1 and sorted(k[1] for k in a.tier.ledger.pending) == [2]
        a.faulty.release("list")
        if running:
            await asyncio.wait(running, timeout=10)
        assert await asyncio.wait_for(a.tier.wait("job", 2, 0, None), 10) == [a.tier.url]
        with pytest.raises(TierError, match="deleted on request"):
            await a.tier.wait("job", 1, 0, None)
        await a.tier.stop(1.0)
    asyncio.run(body())


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"job": "job", "step": 1}', b'{"job": "other", "step": 1, '
                                 b'"deleted_at": 1}', b'{"job": "job", "step": 1, "deleted_at": "NaN"}',
                                 b"[" * 100000, b"x" * (2 << 20)])
def test_a_malformed_tombstone_covers_every_save_of_its_step(raw: bytes) -> None:
    stone = Tombstone.parse("job", 1, raw)
    assert stone.deleted_at == math.inf and stone.by == "malformed"
    fresh = Tombstone("job", 1, 5.0, frozenset({"g"}), "n0")
    assert fresh.merged(stone) == fresh  # a new deletion replaces an unreadable tombstone


def test_a_tombstone_round_trips_and_merges() -> None:
    a = Tombstone("job", 7, 10.0, frozenset({"g1"}), "n0")
    assert Tombstone.parse("job", 7, a.to_json()) == a
    b = Tombstone("job", 7, 20.0, frozenset({"g2"}), "n1").merged(a)
    assert b.deleted_at == 20.0 and b.generations == {"g1", "g2"}
