"""keep_persistent, in process: old steps go, manifests before data."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from tierckptd.fakes import FaultyBackend

from .rig import Rig, until


class _Recording(FaultyBackend):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.deleted: list[list[str]] = []

    def delete(self, keys: Sequence[str]) -> None:
        self.deleted.append(list(keys))
        super().delete(keys)


def test_keep_persistent_deletes_old_steps_manifests_first_then_data(tmp_path: Path) -> None:
    async def body() -> None:
        rig = Rig(tmp_path, keep_persistent=2)
        recording = _Recording(rig.memory)
        rig.tier.calls.backend = recording
        await rig.tier.start()
        for step in (1, 2, 3, 4):
            rig.save("job", step, 0, {"x": b"v%d" % step})
            await asyncio.wait_for(rig.tier.wait("job", step, 0, None), 10)

        def steps() -> list[int]:
            return sorted({int(k.split("/")[2]) for k in rig.memory.list("job/") if "/gc/" not in k})

        await until(lambda: steps() == [3, 4], "retention of steps 1 and 2")
        retained = [keys for keys in recording.deleted if keys and "/gc/" not in keys[0]]  # collection markers
        for step in (1, 2):
            kinds = [keys[0].split("/")[1] for keys in retained if f"/{step:020d}/" in keys[0]]
            assert kinds == ["manifests", "data"], (step, retained)
        assert sorted(await rig.tier.catalog("job")) == [3, 4]
        await rig.tier.stop(1.0)

    asyncio.run(body())
