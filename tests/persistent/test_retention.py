"""keep_persistent, in process: old steps go, manifests before data (per-shard) or before the
collection of the chunks no other step names (content)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from tierckptd.fakes import FaultyBackend
from tierckptd.local.manifest import Manifest
from tierckptd.persistent import manifest_key
from tierckptd.persistent.layout import content_key

from .rig import Rig, until


class _Recording(FaultyBackend):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.deleted: list[list[str]] = []

    def delete(self, keys: Sequence[str]) -> None:
        self.deleted.append(list(keys))
        super().delete(keys)


@pytest.mark.parametrize("layout", ["content", "per-shard"])
def test_keep_persistent_deletes_old_steps_manifests_first_then_data(tmp_path: Path, layout: str) -> None:
    async def body() -> None:
        rig = Rig(tmp_path, keep_persistent=2, layout=layout)
        recording = _Recording(rig.memory)
        rig.tier.calls.backend = recording
        await rig.tier.start()
        chunks: dict[int, set[str]] = {}  # chunk keys first stored by each step
        for step in (1, 2, 3, 4):
            before = set(rig.memory.list("job/content/"))
            rig.save("job", step, 0, {"x": b"v%d" % step, "same": b"s" * 100})
            await asyncio.wait_for(rig.tier.wait("job", step, 0, None), 10)
            chunks[step] = set(rig.memory.list("job/content/")) - before

        def steps() -> list[int]:
            return sorted({int(k.split("/")[2]) for k in rig.memory.list("job/") if k.split("/")[1] in kinds})

        kinds = ("manifests", "data")
        await until(lambda: steps() == [3, 4], "retention of steps 1 and 2")
        retained = [keys for keys in recording.deleted if keys and keys[0].split("/")[1] in kinds]
        for step in (1, 2):
            done = [keys[0].split("/")[1] for keys in retained if f"/{step:020d}/" in keys[0]]
            assert done == (["manifests", "data"] if layout == "per-shard" else ["manifests"]), (step, retained)
        if layout == "content":  # then the chunks only steps 1 and 2 named are collected, the shared one kept
            named = _chunks_named(rig, 3) | _chunks_named(rig, 4)
            assert len(named) == 3 and len(chunks[1]) == 2 and named & chunks[1]
            await until(lambda: set(rig.memory.list("job/content/")) == named and not rig.memory.list("job/gc/"),
                        "the collection, its marker removed")
            assert rig.memory.list("job/leases/") == []
        assert sorted(await rig.tier.catalog("job")) == [3, 4]
        await rig.tier.stop(1.0)

    asyncio.run(body())


def _chunks_named(rig: Rig, step: int) -> set[str]:
    man = Manifest.from_json(rig.memory.get_bytes(manifest_key("job", step, 0, 1)))
    return {content_key("job", d, n, s.codec) for s in man.shards for d, n, _ in s.chunks}
