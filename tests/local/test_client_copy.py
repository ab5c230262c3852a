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
