"""Regression tests from the correctness review (races between threads, accounting, error mapping)."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import tierckpt
from tierckpt.common import checksum as _checksum
from tierckpt import client as client_mod
from tierckpt._buffers import as_buffer
from tierckpt.errors import CapacityError, TierckptError
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckptd import store as store_mod
from tierckptd.store import LocalStore


def test_failed_copy_never_writes_through_a_closed_fd(scratch, monkeypatch):
    """A piece that fails must not leave other pieces running after _copy_into closed their fd:
    the fd number is reused by the next open, and a stray pwrite lands in an unrelated file."""
    monkeypatch.setattr(client_mod, "_COPY_PIECE", 4096)
    real = client_mod.pwrite_all
    calls: list[int] = []

    def flaky(fd, view, offset):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        time.sleep(0.2)
        real(fd, view, offset)

    monkeypatch.setattr(client_mod, "pwrite_all", flaky)
    target = scratch / "staged"
    target.write_bytes(b"\0" * (4 * 4096))
    victim = scratch / "victim"
    c = tierckpt.Client("unix:///nonexistent.sock", io_threads=1)
    try:
        buf = as_buffer("a", np.full(4 * 4096, 7, dtype=np.uint8))
        staged = {"a": pb.StagedShard(name="a", path=str(target), recycled=False)}
        with pytest.raises(TierckptError):  # not a bare OSError
            c._copy_into([buf], staged)
        # The fd _copy_into used is closed now; the process's next open may get its number.
        vfd = os.open(victim, os.O_RDWR | os.O_CREAT)
        try:
            if vfd != calls[0]:
                os.dup2(vfd, calls[0])
            time.sleep(0.8)  # any piece still queued would run now
        finally:
            os.close(vfd)
            if vfd != calls[0]:
                os.close(calls[0])
        assert victim.read_bytes() == b"", "a stray piece wrote into a file opened after save() failed"
    finally:
        c.close()


def test_enospc_while_copying_is_a_capacity_error(scratch, monkeypatch):
    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(client_mod, "pwrite_all", full)
    target = scratch / "staged"
    target.write_bytes(b"\0" * 16)
    c = tierckpt.Client("unix:///nonexistent.sock", io_threads=1)
    try:
        staged = {"a": pb.StagedShard(name="a", path=str(target), recycled=False)}
        with pytest.raises(CapacityError):
            c._copy_into([as_buffer("a", b"x" * 16)], staged)
    finally:
        c.close()


def test_bytes_being_committed_still_count_against_capacity(scratch, monkeypatch):
    """While commit renames/fsyncs files outside the lock, their bytes are neither staging nor
    committed; a concurrent begin must still see them as used, or the tier over-commits."""
    store = LocalStore(scratch / "data", "n0", capacity=10_000, keep_local=1)
    store.open()
    data = b"x" * 6000
    st = store.begin("a", 1, 0, 1, [("s", len(data), "", ())])
    with open(st.files["s"].path, "r+b") as fh:
        fh.write(data)
    entered, release = threading.Event(), threading.Event()
    real = store_mod.write_temp

    def slow_manifest(path, payload, *, fsync):
        entered.set()
        assert release.wait(10)
        return real(path, payload, fsync=fsync)

    monkeypatch.setattr(store_mod, "write_temp", slow_manifest)
    t = threading.Thread(target=store.commit, args=(st.save_id, {"s": _checksum.digest(data)}))
    t.start()
    try:
        assert entered.wait(10)
        assert store.usage().used == 6000
        with pytest.raises(CapacityError):
            store.begin("b", 1, 0, 1, [("s", 6000, "", ())])
    finally:
        release.set()
        t.join(10)
    assert store.usage().used == 6000 and store.get("a", 1, 0) is not None


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_local_copy_short_or_gone_is_a_tierckpt_error(daemon, damage):
    """A local data file shorter than its manifest says is a failed copy: DataLossError (and the
    next tier is tried); one gone (evicted or re-saved between the Restore reply and the
    client's map) is asked for again, then NotFoundError, and the daemon's copy is not dropped
    as corrupt. Never a ValueError/FileNotFoundError from mmap/open."""
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": np.arange(4096, dtype=np.int32)}).result(30)
    data_file = next(daemon.local_dir.glob("jobs/job/*/*/x.*"))
    if damage == "truncate":
        os.truncate(data_file, 100)
    else:
        data_file.unlink()
    with daemon.client() as c:
        if damage == "truncate":
            with pytest.raises(tierckpt.DataLossError):
                c.restore("job", 0)
        else:
            with pytest.raises(tierckpt.NotFoundError):
                c.restore("job", 0)
            assert c.latest("job") == 1  # not removed as "corrupt"


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
    real = store_mod._rmdir_quiet

    def slow(path):
        if path == a.dir:  # A's files are in place, its commit not finished
            published.set()
            assert release.wait(10)
        real(path)

    monkeypatch.setattr(store_mod, "_rmdir_quiet", slow)
    t = threading.Thread(target=store.commit, args=(a.save_id, {"s": _checksum.digest(b"A" * 100)}))
    t.start()
    try:
        assert published.wait(10)
        b = begin_write(b"B" * 100)
        store.commit(b.save_id, {"s": _checksum.digest(b"B" * 100)})
    finally:
        release.set()
        t.join(10)
    monkeypatch.setattr(store_mod, "_rmdir_quiet", real)
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
    assert _bytes_on_disk(root) == u.used, (u, _bytes_on_disk(root))


def test_enospc_on_the_daemon_is_resource_exhausted():
    """A full local_dir met outside begin (a streamed chunk, a commit's rename) is the capacity
    condition the contract names: RESOURCE_EXHAUSTED (CapacityError), not INTERNAL."""
    import asyncio

    import grpc
    from tierckptd import server

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            raise Aborted(code, details)

    @server._rpc
    async def handler(self, request, context):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(Aborted) as info:
        asyncio.run(handler(None, None, Context()))
    assert info.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
