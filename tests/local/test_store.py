"""Unit tests of the local store (no daemon): recycling, pins, capacity, start-up recovery."""

from __future__ import annotations

import os

import pytest
from tierckpt.common import checksum as _checksum
from tierckpt.errors import CapacityError, DataLossError, InvalidArgumentError
from tierckptd.local.rules import charge_file, charge_rank
from tierckptd.local.store import LocalStore


def _save(store: LocalStore, job: str, step: int, data: dict[str, bytes], rank: int = 0, world: int = 1, **kw):
    st = store.begin(job, step, rank, world, [(n, len(b), "", ()) for n, b in data.items()])
    for n, b in data.items():
        with open(st.files[n].path, "r+b") as fh:
            fh.write(b)
    man, ev = store.commit(st.save_id, {n: _checksum.digest(b) for n, b in data.items()}, **kw)
    return st, man, ev


@pytest.fixture
def store(scratch):
    s = LocalStore(scratch / "data", "n0", capacity=1_000_000, keep_local=1)
    s.open()
    return s


def test_evicted_files_are_recycled_for_same_size_shards(store):
    st1, _, _ = _save(store, "j", 1, {"a": b"1" * 100})
    inode = os.stat(store.shard_path(store.get("j", 1, 0), "a")).st_ino
    _save(store, "j", 2, {"a": b"2" * 100})  # keep_local=1 evicts step 1 into the recycle pool
    assert store.get("j", 1, 0) is None and store.usage().recycle == 100
    st3 = store.begin("j", 3, 0, 1, [("a", 100, "", ())])
    assert st3.files["a"].recycled and os.stat(st3.files["a"].path).st_ino == inode
    assert store.usage().recycle == 0
    assert not st1.files["a"].recycled


def test_a_lent_file_joins_the_pool_only_when_its_last_reader_releases_it(store):
    _save(store, "j", 1, {"a": b"1" * 100})
    man = store.get("j", 1, 0)
    inode = os.stat(store.shard_path(man, "a")).st_ino
    store.lend(man)  # two readers map it
    store.lend(man)
    _save(store, "j", 2, {"a": b"2" * 100})  # evicts step 1 while it is mapped: held, not pooled
    st = store.begin("j", 3, 0, 1, [("a", 100, "", ())])
    assert not st.files["a"].recycled
    store.abort(st.save_id)
    assert store.release("j", 1, 0, man.generation)
    assert not store.begin("j", 3, 0, 1, [("a", 100, "", ())]).files["a"].recycled  # one reader left
    assert store.release("j", 1, 0, man.generation)
    assert not store.release("j", 1, 0, man.generation)  # no loan left
    st = store.begin("j", 4, 0, 1, [("a", 100, "", ())])
    assert st.files["a"].recycled and os.stat(st.files["a"].path).st_ino == inode


def test_a_file_released_before_eviction_is_recycled(store):
    _save(store, "j", 1, {"a": b"1" * 100})
    man = store.get("j", 1, 0)
    store.lend(man)
    assert store.release("j", 1, 0, man.generation)
    _save(store, "j", 2, {"a": b"2" * 100})
    assert store.usage().recycle == 100
    assert store.begin("j", 3, 0, 1, [("a", 100, "", ())]).files["a"].recycled


def test_held_files_are_dropped_first_when_room_is_needed(scratch):
    s = LocalStore(scratch / "data", "n0", capacity=2 * charge_rank([1000]) + charge_file(1000) // 2, keep_local=1)
    s.open()
    _save(s, "j", 1, {"a": b"1" * 1000})
    man = s.get("j", 1, 0)
    path = s.shard_path(man, "a")
    fd = os.open(path, os.O_RDONLY)
    try:
        s.lend(man)  # never released (a client that died)
        _save(s, "j", 2, {"a": b"2" * 1000})
        _save(s, "j", 3, {"b": b"3" * 1500})  # needs the held file's room: it is unlinked
        assert os.pread(fd, 4, 0) == b"1111"  # what the reader holds never changes
        assert not s.release("j", 2, 0, "nope")
        assert s.release("j", 1, 0, man.generation)  # a late release of a dropped file is harmless
    finally:
        os.close(fd)


def test_pinned_step_survives_retention_until_unpinned(store):
    _save(store, "j", 1, {"a": b"x"})
    store.pin("j", 1, "drain")
    _save(store, "j", 2, {"a": b"y"})
    assert store.get("j", 1, 0) is not None
    store.unpin("j", 1, "drain")
    assert store.get("j", 1, 0) is None


def test_capacity_evicts_undrained_only_when_forced(scratch):
    evicted: list = []
    s = LocalStore(scratch / "d2", "n0", capacity=100_000, keep_local=5, on_evict=evicted.append)
    s.open()
    _save(s, "j", 1, {"a": b"1" * 40_000})
    _save(s, "j", 2, {"a": b"2" * 40_000})
    s.pin("j", 1, "drain")
    s.begin("j", 3, 0, 1, [("a", 50_000, "", ())])
    assert s.get("j", 1, 0) is None and s.counters["evictions_capacity_undrained"] == 1
    with pytest.raises(CapacityError):
        s.begin("j", 4, 0, 1, [("a", 50_000, "", ())])  # step 2 is the newest complete: kept
    assert s.get("j", 2, 0) is not None


def test_verify_rejects_bad_checksum_and_keeps_old_commit(store):
    _save(store, "j", 1, {"a": b"good"})
    st = store.begin("j", 1, 0, 1, [("a", 4, "", ())])
    with open(st.files["a"].path, "r+b") as fh:
        fh.write(b"evil")
    with pytest.raises(DataLossError):
        store.commit(st.save_id, {"a": _checksum.digest(b"good")}, verify=True)
    man = store.get("j", 1, 0)
    assert open(store.shard_path(man, "a"), "rb").read() == b"good"
    assert not any((store.root / "staging").iterdir())


def test_reopen_rebuilds_catalog_and_drops_uncommitted(scratch, store):
    _save(store, "j", 1, {"a": b"one", "b": b"two"}, metadata_json='{"k": 1}')
    rank_dir = store.shard_path(store.get("j", 1, 0), "a").parent
    (rank_dir / "a.interrupted-resave").write_bytes(b"junk")
    orphan = store.root / "jobs" / "j" / f"{5:020d}" / "rank-0000000"
    orphan.mkdir(parents=True)
    (orphan / "a.x").write_bytes(b"no manifest")
    st = store.begin("j", 9, 0, 1, [("a", 3, "", ())])
    store.close()  # as if the process died
    again = LocalStore(store.root, "n0", capacity=1_000_000, keep_local=1)
    again.open()
    man = again.get("j", 1, 0)
    assert man is not None and man.metadata_json == '{"k": 1}' and again.usage().committed == 6
    assert again.usage().charged == charge_rank([3, 3])
    assert not orphan.exists() and not (rank_dir / "a.interrupted-resave").exists()
    assert not st.dir.exists()


def test_write_chunk_bounds(store):
    st = store.begin("j", 1, 0, 1, [("a", 4, "", ())], stream=True)
    fds: dict = {}
    with pytest.raises(InvalidArgumentError, match="offset"):
        store.write_chunk(st.save_id, "a", 2, b"abc", fds)
    with pytest.raises(InvalidArgumentError, match="shard"):
        store.write_chunk(st.save_id, "zz", 0, b"a", fds)
    store.write_chunk(st.save_id, "a", 0, b"ab", fds)
    with pytest.raises(InvalidArgumentError, match="fewer bytes"):
        store.commit(st.save_id, {"a": _checksum.digest(b"ab\0\0")})
    for fd in fds.values():
        os.close(fd)


def test_restore_from_a_remote_tier_is_not_evicted_by_its_own_commit(scratch):
    """A fetched step older than keep_local newer complete steps survives until the client maps it."""
    import asyncio

    from tierckptd.node import Node
    from tierckptd.tiers import Deleted, RemoteTier, Verified

    store = LocalStore(scratch / "d3", "n0", capacity=1_000_000, keep_local=1)
    store.open()
    _save(store, "j", 9, {"a": b"new"})  # the newest complete step

    class FakeRemote(RemoteTier):
        name = "peer"

        async def catalog(self, job):
            return {}

        async def fetch(self, job, step, rank, job_owner=None):
            _, man, _ = _save(store, job, step, {"a": b"old"})  # what a real fetch commits
            return man

        async def wait(self, job, step, rank, timeout):
            return []

        async def delete(self, job, step):
            return Deleted()

        async def verify(self, job, step):
            return Verified()

    async def run():
        node = Node(store, [FakeRemote()], node_id="n0", staging_timeout=60)
        res = await node.restore("j", 0, 5)
        assert res.tier == "peer"
        assert [open(p, "rb").read() for p in res.paths] == [b"old"]
        await node.stop(1)

    asyncio.run(run())


def test_a_second_store_on_the_same_dir_is_refused(store):
    from tierckptd.config import ConfigError

    other = LocalStore(store.root, "n1")
    with pytest.raises(ConfigError, match=r"local_dir.*in use"):
        other.open()


def test_idle_recycle_pool_is_released(scratch):
    s = LocalStore(scratch / "d4", "n0", capacity=1_000_000, keep_local=1)
    s.open()
    _save(s, "j", 1, {"a": b"1" * 100})
    _save(s, "j", 2, {"a": b"2" * 100})
    assert s.usage().recycle == 100 and s.usage().charged == charge_rank([100]) + charge_file(100)
    s.reclaim_expired(60)
    assert s.usage().recycle == 100  # a save began recently: keep the pool
    s._saves.last_begin -= 120
    s.reclaim_expired(60)
    assert s.usage().recycle == 0 and not any((s.root / "recycle").iterdir())


def test_corruption_report_for_an_older_generation_keeps_the_newer_save(store):
    import asyncio

    from tierckptd.node import Node

    _, old, _ = _save(store, "j", 1, {"a": b"old"})
    _, new, _ = _save(store, "j", 1, {"a": b"new"})  # re-saved after the client's failed check
    assert not store.remove_rank("j", 1, 0, "test", generation=old.generation)

    async def run():
        node = Node(store, [], node_id="n0", staging_timeout=60)
        res = await node.restore("j", 0, 1, local_corrupt=True, corrupt_generation=old.generation)
        assert res.tier == "local" and res.manifest.generation == new.generation
        await node.stop(1)

    asyncio.run(run())
    assert store.get("j", 1, 0).generation == new.generation
