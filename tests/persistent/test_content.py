"""The content layout: compressed chunks named by hash, deduplicated across steps, collected
when no manifest names them (safe against a crash mid-collection), old layout still readable."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest
from tierckpt.errors import DataLossError
from tierckptd.backends import BackendError
from tierckptd.fakes import FaultyBackend, MemoryBackend
from tierckptd.knobs import KNOBS
from tierckptd.local.manifest import Manifest
from tierckptd.persistent import compress, manifest_key
from tierckptd.persistent.calls import BackendCalls
from tierckptd.persistent.gc import collect

from .rig import Rig, until

CHUNK = 4096


def _floats(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 0.02).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", ""])
def test_every_codec_round_trips_and_floats_shrink(dtype: str) -> None:
    x = _floats(10_001, 1)
    data = {"float32": x.tobytes(), "float16": x.astype(np.float16).tobytes(),
            "bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16).tobytes(),
            "int64": np.arange(5000, dtype=np.int64).tobytes(), "": b"abc" * 999 + b"\x01"}[dtype]
    for setting in compress.SETTINGS:
        codec = compress.choose(setting, dtype)
        stored = compress.encode(codec, data)
        assert compress.decode(codec, stored, len(data)) == data
        if setting == "auto":
            assert len(stored) < len(data) * (0.9 if dtype else 0.1)
    noise = np.random.default_rng(2).bytes(4096)
    assert compress.encode("zstd", noise) == b"\x00" + noise  # stored raw when it does not shrink
    with pytest.raises(DataLossError):
        compress.decode("bg4-zstd", b"\x01garbage", 16)


def _save(rig: Rig, step: int, shards: dict[str, bytes]) -> None:
    rig.save("job", step, 0, shards)


async def _drain(rig: Rig, step: int) -> None:
    await asyncio.wait_for(rig.tier.wait("job", step, 0, None), 10)


async def _restores(memory: object, root: Path, name: str, step: int, want: dict[str, bytes]) -> None:
    reader = Rig(root, node_id=name, memory=memory)  # type: ignore[arg-type]
    await reader.tier.start()
    local = await reader.tier.fetch("job", step, 0)
    for shard, data in want.items():
        assert reader.store.shard_path(local, shard).read_bytes() == data
    await reader.tier.stop(1.0)


def test_unchanged_chunks_are_not_uploaded_again_and_restore_is_byte_exact(tmp_path: Path) -> None:
    base, head = _floats(8 * CHUNK, 3).tobytes(), _floats(CHUNK // 4, 4).tobytes()

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK):
            rig = Rig(tmp_path)
            await rig.tier.start()
            _save(rig, 1, {"base": base, "head": head})
            await _drain(rig, 1)
            first = rig.tier.content.sent
            head2 = _floats(CHUNK // 4, 5).tobytes()
            _save(rig, 2, {"base": base, "head": head2})
            await _drain(rig, 2)
            assert 0 < rig.tier.content.sent - first < CHUNK  # only the changed head went up
            assert first < len(base)  # compressed
            man = Manifest.from_json(rig.memory.get_bytes(manifest_key("job", 2, 0, 1)))
            assert {s.codec for s in man.shards} == {"zstd"} and all(not s.file for s in man.shards)
            assert rig.memory.list("job/leases/") == [] and rig.memory.list("job/data/") == []
            await rig.tier.stop(1.0)
            await _restores(rig.memory, tmp_path, "r", 2, {"base": base, "head": head2})

    asyncio.run(body())


def test_the_per_shard_layout_stays_readable(tmp_path: Path) -> None:
    async def body() -> None:
        old = Rig(tmp_path, node_id="old", layout="per-shard")
        await old.tier.start()
        _save(old, 1, {"m": b"old layout " * 100})
        await _drain(old, 1)
        await old.tier.stop(1.0)
        keys = list(old.memory.objects)
        assert any("/data/" in k for k in keys) and not any("/content/" in k for k in keys)
        await _restores(old.memory, tmp_path, "new", 1, {"m": b"old layout " * 100})

    asyncio.run(body())


class _CrashingDeletes(FaultyBackend):
    """Deletes part of one batch of chunks, then fails as a crashed collector would."""

    def __init__(self, inner: object, rng: random.Random) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.rng = rng

    def delete(self, keys: list[str]) -> None:
        chunks = [k for k in keys if "/content/" in k]
        if chunks:
            self.inner.delete(self.rng.sample(chunks, self.rng.randint(0, len(chunks))))
            raise BackendError("crashed mid-sweep (injected)", retryable=False)
        self.inner.delete(keys)


def test_a_collection_crashing_anywhere_loses_nothing_a_manifest_names(tmp_path: Path) -> None:
    steps = {s: {"w": _floats(4 * CHUNK // 4, 10 + s).tobytes(), "frozen": _floats(CHUNK, 0).tobytes()}
             for s in (1, 2, 3, 4)}

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK):
            rig = Rig(tmp_path)
            await rig.tier.start()
            for s, shards in steps.items():
                _save(rig, s, shards)
                await _drain(rig, s)
            await rig.tier.stop(1.0)
            memory = MemoryBackend(objects=rig.memory.objects)
            for s in (1, 2):  # retention removed the manifests of steps 1 and 2
                memory.delete([manifest_key("job", s, 0, 1)])
            rng = random.Random(7)
            for _ in range(5):  # crashes at random points of the sweep
                calls = BackendCalls(backend=_CrashingDeletes(memory, rng))
                with pytest.raises(BackendError):
                    await collect(calls, "job")
                for s in (3, 4):
                    await _restores(memory, tmp_path, f"r{rng.random()}", s, steps[s])
            assert await collect(BackendCalls(backend=memory), "job") > 0
            assert memory.list("job/gc/") == []
            await _restores(memory, tmp_path, "last", 4, steps[4])
            assert await collect(BackendCalls(backend=memory), "job") == 0

    asyncio.run(body())


def test_chunks_named_by_a_live_lease_are_not_collected(tmp_path: Path) -> None:
    async def body() -> None:
        rig = Rig(tmp_path)
        rig.memory.put_bytes("job/content/ab/orphan-1.raw", b"\x00x")
        rig.memory.put_bytes("job/content/cd/leased-1.raw", b"\x00y")
        rig.memory.put_bytes("job/leases/9999999999999-t.json", b'{"keys": ["job/content/cd/leased-1.raw"]}')
        assert await collect(BackendCalls(backend=rig.memory), "job") == 1
        assert rig.memory.list("job/content/") == ["job/content/cd/leased-1.raw"]

    asyncio.run(body())


def test_a_marker_its_collection_could_not_remove_does_not_hold_up_this_nodes_drains(tmp_path: Path) -> None:
    async def body() -> None:
        rig = Rig(tmp_path, keep_persistent=1)
        rig.faulty.fail("delete", times=20, retryable=False, where="/gc/")  # the store refuses, as if down
        await rig.tier.start()
        for step in (1, 2):
            _save(rig, step, {"w": _floats(1000, step).tobytes()})
            await _drain(rig, step)
        await until(lambda: rig.memory.list("job/manifests/00000000000000000001/") == [], "retention of step 1")
        await until(lambda: rig.memory.list("job/gc/") and not rig.tier.content.collecting, "the collection's end")
        rig.faulty.clear_faults()  # the store is back
        _save(rig, 3, {"w": _floats(1000, 3).tobytes()})
        await _drain(rig, 3)  # within 10 s, not 2 x gc_window (120 s)
        assert rig.memory.list("job/gc/") == []
        await rig.tier.stop(1.0)
        await _restores(rig.memory, tmp_path, "r", 3, {"w": _floats(1000, 3).tobytes()})

    asyncio.run(body())


def test_the_chunks_of_all_shards_of_a_rank_go_up_at_once(tmp_path: Path) -> None:
    shards = {f"s{i}": _floats(CHUNK // 4, 20 + i).tobytes() for i in range(4)}  # one chunk each

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK):
            rig = Rig(tmp_path)
            await rig.tier.start()
            _save(rig, 1, shards)
            await _drain(rig, 1)
            rig.faulty.hang("exists")  # step 2 is unchanged: each chunk is asked about
            _save(rig, 2, shards)
            held = await asyncio.to_thread(lambda: sum(rig.faulty.wait_held("exists", 5) for _ in shards))
            rig.faulty.release("exists")
            assert held == len(shards)  # every shard's chunk was in flight together
            await _drain(rig, 2)
            await rig.tier.stop(1.0)
            await _restores(rig.memory, tmp_path, "r", 2, shards)

    asyncio.run(body())


def test_a_drain_asks_only_about_chunks_the_last_drain_of_its_rank_had(tmp_path: Path) -> None:
    frozen = _floats(3 * CHUNK // 4, 30).tobytes()  # 3 chunks, the same at every step
    steps = {s: {"frozen": frozen, "w": _floats(CHUNK // 4, 30 + s).tobytes()} for s in (1, 2)}

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK):
            rig = Rig(tmp_path)
            await rig.tier.start()
            asked, sent = [], []
            for s, shards in steps.items():
                before = (rig.faulty.calls["exists"], rig.tier.content.sent)
                _save(rig, s, shards)
                await _drain(rig, s)
                asked.append(rig.faulty.calls["exists"] - before[0])
                sent.append(rig.tier.content.sent - before[1])
            assert asked == [0, 3]  # nothing stored before: no question; then only about the unchanged ones
            assert 0 < sent[1] < CHUNK  # the changed chunk went up unasked, the frozen ones not again
            await rig.tier.stop(1.0)

            # A restarted daemon compares with the rank's newest stored manifest (step 2): it asks
            # about the chunks named there and sends only the changed one.
            again = Rig(tmp_path, node_id="n1", memory=rig.memory)
            await again.tier.start()
            step3 = {"frozen": frozen, "w": _floats(CHUNK // 4, 33).tobytes()}
            again.save("job", 3, 0, step3)
            await asyncio.wait_for(again.tier.wait("job", 3, 0, None), 10)
            assert again.faulty.calls["exists"] == 3 and 0 < again.tier.content.sent < CHUNK
            await again.tier.stop(1.0)
            await _restores(rig.memory, tmp_path, "r", 3, step3)

    asyncio.run(body())


def test_a_drain_reads_nothing_while_a_save_is_open_and_waits_at_most_drain_yield(tmp_path: Path) -> None:
    shards = {"w": _floats(CHUNK // 4, 40).tobytes()}

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_yield=60.0):
            rig = Rig(tmp_path)
            await rig.tier.start()
            trainer = rig.store.begin("other", 1, 0, 1, [("x", 16, "", ())])  # a save in flight on the node
            _save(rig, 1, shards)
            await asyncio.sleep(0.5)
            assert rig.tier.content.sent == 0 and rig.faulty.calls["put_bytes"] == 0  # not even hashed (no lease)
            rig.store.abort(trainer.save_id)
            await _drain(rig, 1)  # the save ended: the drain goes on at once
            assert rig.tier.content.sent > 0
        with KNOBS.overridden(chunk_bytes=CHUNK, drain_yield=0.2):
            trainer = rig.store.begin("other", 2, 0, 1, [("x", 16, "", ())])
            _save(rig, 2, {"w": _floats(CHUNK // 4, 41).tobytes()})
            await _drain(rig, 2)  # a save left open does not hold the drain for more than drain_yield a chunk
            rig.store.abort(trainer.save_id)
            await rig.tier.stop(1.0)

    asyncio.run(body())


@pytest.mark.parametrize("codec_threads", [1, 3])
def test_at_most_codec_threads_chunks_are_encoded_and_waiting_to_go_up(tmp_path: Path, codec_threads: int) -> None:
    shards = {f"s{i}": _floats(CHUNK // 4, 50 + i).tobytes() for i in range(5)}  # one chunk each

    async def body() -> None:
        with KNOBS.overridden(chunk_bytes=CHUNK, codec_threads=codec_threads, upload_threads=8):
            rig = Rig(tmp_path)
            await rig.tier.start()
            rig.tier.uploader._owner_checked[("job", "")] = True  # the drain's owner check is done: no listing
            rig.faulty.hang("list")  # the drain's look for collections in flight: its lease is stored
            _save(rig, 1, shards)
            assert await asyncio.to_thread(rig.faulty.wait_held, "list", 5)
            rig.faulty.hang("put_bytes")
            rig.faulty.release("list")
            held = await asyncio.to_thread(lambda: sum(rig.faulty.wait_held("put_bytes", 1) for _ in range(6)))
            rig.faulty.release("put_bytes")
            await _drain(rig, 1)
            await rig.tier.stop(1.0)
            assert held == codec_threads  # read, encoded and waiting to go up: one chunk per codec slot

    asyncio.run(body())
