"""Local store under concurrency and failure: accounting of bytes in flight, overlapping
commits of one rank, failed begins (no daemon)."""

from __future__ import annotations

import errno
import os
import threading

import pytest
from tierckpt.common import checksum as _checksum
from tierckpt.errors import CapacityError
from tierckptd.local import store as store_mod
from tierckptd.local.commit import Committer
from tierckptd.local.localfs import LocalDir
from tierckptd.local.rules import charge_file, charge_rank
from tierckptd.local.store import LocalStore

from ..threads import Checked


def test_bytes_being_committed_still_count_against_capacity(scratch, monkeypatch):
    """While commit renames/fsyncs files outside the lock, their bytes are neither staging nor
    committed; a concurrent begin must still see them as used, or the tier over-commits."""
    store = LocalStore(scratch / "data", "n0", capacity=20_000, keep_local=1)
    store.open()
    data = b"x" * 6000  # charged 6000 + a 4096-byte manifest
    st = store.begin("a", 1, 0, 1, [("s", len(data), "", ())])
    with open(st.files["s"].path, "r+b") as fh:
        fh.write(data)
    entered, release = threading.Event(), threading.Event()
    real = LocalDir.write_temp

    def slow_manifest(self, dir_fd, name, payload, *, fsync):
        entered.set()
        assert release.wait(10)
        return real(self, dir_fd, name, payload, fsync=fsync)

    monkeypatch.setattr(LocalDir, "write_temp", slow_manifest)
    t = Checked(store.commit, st.save_id, {"s": _checksum.digest(data)})
    t.start()
    try:
        assert entered.wait(10)
        assert store.usage().used == 6000 and store.usage().charged == charge_rank([6000])
        with pytest.raises(CapacityError):
            store.begin("b", 1, 0, 1, [("s", 10_000, "", ())])
    finally:
        release.set()
        t.join(30)  # the commit in the thread finished, and raised nothing
    usage = store.usage()
    assert usage.charged == charge_rank([6000]) and usage.used == 6000 and store.get("a", 1, 0) is not None


def test_concurrent_resaves_of_one_rank_keep_disk_and_catalog_in_agreement(scratch, monkeypatch):
    """Two saves of the same rank whose commits overlap (the first already left _open, so the
    second does not supersede it): the manifest on disk and the catalog must name the same
    generation, and its files must exist, or a restart loses the rank."""
    root = scratch / "data"
    store = LocalStore(root, "n0", capacity=100_000, keep_local=2)
    store.open()

    def begin_write(data: bytes):
        st = store.begin("j", 1, 0, 1, [("s", len(data), "", ())])
        with open(st.files["s"].path, "r+b") as fh:
            fh.write(data)
        return st

    a = begin_write(b"A" * 100)
    published, release = threading.Event(), threading.Event()
    real = Committer.place

    def slow(self, st, man, stats, fsync):
        tmp = real(self, st, man, stats, fsync)
        if st.save_id == a.save_id:  # A's files are in place, its commit not finished
            published.set()
            assert release.wait(10)
        return tmp

    monkeypatch.setattr(Committer, "place", slow)
    t = Checked(store.commit, a.save_id, {"s": _checksum.digest(b"A" * 100)})
    t.start()
    try:
        assert published.wait(10)
        b = begin_write(b"B" * 100)
        store.commit(b.save_id, {"s": _checksum.digest(b"B" * 100)})
    finally:
        release.set()
        t.join(30)  # the commit in the thread finished, and raised nothing
    monkeypatch.setattr(Committer, "place", real)
    man = store.get("j", 1, 0)
    on_disk = store_mod.Manifest.from_json((store._rank_dir("j", 1, 0) / "manifest.json").read_bytes())
    assert on_disk.generation == man.generation
    assert store.shard_path(man, "s").read_bytes() in (b"A" * 100, b"B" * 100)
    store.close()  # as if the process died
    again = LocalStore(root, "n0", capacity=100_000, keep_local=2)
    again.open()
    assert again.get("j", 1, 0) is not None, "the rank was lost at restart"


def _bytes_on_disk(root) -> int:
    return sum(p.stat().st_size for sub in ("jobs", "staging", "recycle") for p in (root / sub).rglob("*")
               if p.is_file() and p.name != "manifest.json")


def _charged_on_disk(root) -> int:
    """What the files on disk are charged: each data file at least MIN_CHARGE, each rank (committed
    or staging) one manifest."""
    from tierckptd.local.rules import MIN_CHARGE

    files = [p for sub in ("jobs", "staging", "recycle") for p in (root / sub).rglob("*") if p.is_file()]
    ranks = {p.parent for p in files if p.name == "manifest.json"} | set((root / "staging").iterdir())
    return sum(charge_file(p.stat().st_size) for p in files if p.name != "manifest.json") + MIN_CHARGE * len(ranks)


def test_failed_begin_returns_untouched_recycled_files(scratch, monkeypatch):
    """begin takes recycled files out of the pool before creating the staging files; if creating
    one fails, the recycled files not yet moved must not stay on disk unaccounted."""
    root = scratch / "data"
    store = LocalStore(root, "n0", capacity=100_000, keep_local=1)
    store.open()
    for step in (1, 2):
        st = store.begin("j", step, 0, 1, [("r", 100, "", ())])
        store.commit(st.save_id, {"r": _checksum.digest(b"\0" * 100)})
    assert store.usage().recycle == 100  # step 1's file
    real = os.ftruncate

    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "ftruncate", full)
    with pytest.raises(CapacityError):
        store.begin("j", 3, 0, 1, [("fresh", 50, "", ()), ("r", 100, "", ())])
    monkeypatch.setattr(os, "ftruncate", real)
    u = store.usage()
    assert _charged_on_disk(root) == u.charged, (u, _charged_on_disk(root))
    assert _bytes_on_disk(root) == u.used, (u, _bytes_on_disk(root))
