"""Client-side copy into staging files: failures are tierckpt errors and never write through a closed fd."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
import tierckpt
from tierckpt import _transfer as transfer_mod
from tierckpt._buffers import as_buffer
from tierckpt.errors import CapacityError, TierckptError
from tierckpt.v1 import tierckpt_pb2 as pb


def test_failed_copy_never_writes_through_a_closed_fd(scratch, monkeypatch):
    """A piece that fails must not leave other pieces running after copy_into closed their fd:
    the fd number is reused by the next open, and a stray pwrite lands in an unrelated file."""
    monkeypatch.setattr(transfer_mod, "_COPY_PIECE", 4096)
    real = transfer_mod.pwrite_all
    calls: list[int] = []

    def flaky(fd, view, offset):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        time.sleep(0.2)
        real(fd, view, offset)

    monkeypatch.setattr(transfer_mod, "pwrite_all", flaky)
    target = scratch / "staged"
    target.write_bytes(b"\0" * (4 * 4096))
    victim = scratch / "victim"
    c = tierckpt.Client("unix:///nonexistent.sock", io_threads=1)
    try:
        buf = as_buffer("a", np.full(4 * 4096, 7, dtype=np.uint8))
        staged = {"a": pb.StagedShard(name="a", path=str(target), recycled=False)}
        with pytest.raises(TierckptError):  # not a bare OSError
            transfer_mod.copy_into(c._io, c._maps, [buf], staged)
        # The fd copy_into used is closed now; the process's next open may get its number.
        vfd = os.open(victim, os.O_RDWR | os.O_CREAT)
        try:
            if vfd != calls[0]:
                os.dup2(vfd, calls[0])
            # Any piece still queued runs now: the one io thread takes work in order, so once a
            # task submitted after them has run, every piece has.
            c._io.submit(lambda: None).result(60)
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

    monkeypatch.setattr(transfer_mod, "pwrite_all", full)
    target = scratch / "staged"
    target.write_bytes(b"\0" * 16)
    c = tierckpt.Client("unix:///nonexistent.sock", io_threads=1)
    try:
        staged = {"a": pb.StagedShard(name="a", path=str(target), recycled=False)}
        with pytest.raises(CapacityError):
            transfer_mod.copy_into(c._io, c._maps, [as_buffer("a", b"x" * 16)], staged)
    finally:
        c.close()


def _mapped(path_part: str) -> list[str]:
    with open("/proc/self/maps") as fh:
        return [line for line in fh if path_part in line]


def test_stale_kept_maps_are_unmapped_after_a_save_and_all_on_close(scratch):
    # Unmapping a file whose inode is gone frees its pages; left to the garbage collector it ran
    # in the middle of a later save's blocking time (a 1 s stall at the third save of a job).
    files = []
    for i in range(3):
        p = scratch / f"f{i}"
        p.write_bytes(b"\0" * (2 << 20))
        files.append(str(p))
    kept = transfer_mod.StagingMaps(keep=2)
    kept.new_save()
    old = kept.get(files[0], 2 << 20)
    for _ in range(3):  # three saves that use only the other files
        kept.new_save()
        assert kept.get(files[1], 2 << 20) is not None
        kept.trim()
    assert old is not None and old.closed  # not used for `keep` saves: unmapped by trim, not by gc
    recent = kept.get(files[1], 2 << 20)
    assert recent is not None and not recent.closed
    kept.close()
    assert recent.closed and not _mapped(str(scratch))


def test_a_closed_client_unmaps_the_staging_files_it_kept(daemon_factory):
    d = daemon_factory(args=("--keep-local", "1"))
    c = tierckpt.Client(d.address)
    state = {"w": np.ones(4 << 20, np.uint8)}
    for step in range(1, 5):  # from step 3 on, saves recycle files: their maps are kept
        c.save("job", step, 0, 1, state).result(60)
    assert _mapped(str(d.local_dir))
    c.close()
    assert not _mapped(str(d.local_dir))
