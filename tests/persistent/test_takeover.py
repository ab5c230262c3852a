"""Take-over, in process: a fake ClusterView decides who is down and who holds copies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tierckptd.knobs import KNOBS
from tierckptd.local.manifest import Manifest
from tierckptd.persistent import data_key, manifest_key

from .rig import URL, FakeCluster, Rig, until

KEY = ("job", 2, 0)


def _holder(tmp_path: Path, node_id: str = "n1", **kw) -> tuple[Rig, Manifest]:
    """``node_id`` holds a selected replica of n0's rank 0 of step 2 (generation g0)."""
    rig = Rig(tmp_path, node_id=node_id, cluster=FakeCluster(node_id), **kw)
    man = rig.save(*KEY, {"model": b"M" * 1000, "optim": b"O" * 10}, world=2, node="n0", generation="g0")
    return rig, man


@pytest.mark.parametrize("layout", ["content", "per-shard"])
def test_owner_down_past_grace_the_first_holder_drains_it_in_the_owners_form(tmp_path: Path, layout: str) -> None:
    async def body() -> None:
        rig, _man = _holder(tmp_path, layout=layout)
        await rig.tier.start()
        with KNOBS.overridden(takeover_grace=10.0):
            rig.cluster.down["n0"] = 9.9
            await rig.tier.takeover.check()
            assert KEY not in rig.tier.ledger.pending  # not yet: within the grace period
            rig.cluster.down["n0"] = 10.0
            await rig.tier.takeover.check()
        assert KEY in rig.tier.ledger.pending
        assert await asyncio.wait_for(rig.tier.wait(*KEY, None), 10) == [URL]
        stored = Manifest.from_json(rig.memory.get_bytes(manifest_key(*KEY, 2)))
        assert stored.node == "n0" and stored.generation == "g0"
        if layout == "per-shard":
            assert {s.file for s in stored.shards} == {"model.g0", "optim.g0"}
            assert rig.memory.list("job/data/") == sorted(data_key(*KEY, s) for s in stored.shards)
        else:  # chunks are named by content: the owner's drain of this save names the same ones
            assert {s.file for s in stored.shards} == {""} and all(s.chunks for s in stored.shards)
            assert rig.memory.list("job/data/") == [] and len(rig.memory.list("job/content/")) == 2
        reader = Rig(tmp_path, node_id="r", memory=rig.memory)
        await reader.tier.start()
        local = await reader.tier.fetch(*KEY)
        assert reader.store.shard_path(local, "model").read_bytes() == b"M" * 1000
        await reader.tier.stop(1.0)
        await rig.tier.stop(1.0)

    asyncio.run(body())


def test_a_holder_that_is_not_first_after_the_owner_waits(tmp_path: Path) -> None:
    async def body() -> None:
        rig, _man = _holder(tmp_path, node_id="n2")
        rig.cluster.holders[KEY] = ["n1"]  # n1 comes first after n0 on the ring
        rig.cluster.down["n0"] = 60.0
        await rig.tier.takeover.check()
        assert KEY not in rig.tier.ledger.pending
        rig.cluster.down["n1"] = 1.0  # n1 is down too: n2 is now the first live holder
        await rig.tier.start()
        await rig.tier.takeover.check()
        assert await asyncio.wait_for(rig.tier.wait(*KEY, None), 10) == [URL]
        await rig.tier.stop(1.0)

    asyncio.run(body())


def test_nothing_is_taken_over_when_the_owner_is_up_drained_it_or_there_is_no_cluster(tmp_path: Path) -> None:
    async def body() -> None:
        rig, man = _holder(tmp_path / "up")
        await rig.tier.takeover.check()  # the owner is up
        assert KEY not in rig.tier.ledger.pending and KEY in rig.tier.takeover.copies

        rig, man = _holder(tmp_path / "drained")
        owner_form = rig.tier.uploader.owner_form(man)
        rig.memory.put_bytes(manifest_key(*KEY, 2), owner_form.to_json())  # the owner drained it
        rig.cluster.down["n0"] = 60.0
        await rig.tier.takeover.check()
        assert KEY not in rig.tier.ledger.pending and KEY not in rig.tier.takeover.copies

        lone = Rig(tmp_path / "lone", node_id="n1")  # no peer tier: no cluster view
        lone.save(*KEY, {"model": b"M"}, world=2, node="n0", generation="g0")
        await lone.tier.takeover.check()
        assert KEY not in lone.tier.ledger.pending

    asyncio.run(body())


def test_the_watcher_takes_over_on_its_own(tmp_path: Path) -> None:
    async def body() -> None:
        rig, _man = _holder(tmp_path)
        rig.cluster.down["n0"] = 1.0
        with KNOBS.overridden(takeover_grace=0.5, takeover_check_interval=0.01):
            await rig.tier.start()
            await until(lambda: rig.memory.exists(manifest_key(*KEY, 2)), "the take-over")
            await rig.tier.stop(1.0)

    asyncio.run(body())
