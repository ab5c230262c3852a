"""tierckptd.libc: the C calls Python's os module lacks raise OSError with the call's errno."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest
from tierckptd import libc


def test_calls_work_and_failures_carry_their_errno(tmp_path: Path) -> None:
    assert libc.available()
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        libc.fallocate(fd, 1, 0, 1 << 20)  # FALLOC_FL_KEEP_SIZE: blocks allocated, size unchanged
        assert os.fstat(fd).st_size == 0 and os.fstat(fd).st_blocks * 512 >= 1 << 20
        os.ftruncate(fd, 1 << 16)
        libc.sync_file_range(fd, 0, 1 << 16, 1 | 2 | 4)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        libc.fallocate(-1, 1, 0, 4096)  # not a descriptor (a closed one's number may be reused)
    assert e.value.errno == errno.EBADF
    with pytest.raises(OSError) as e:
        libc.sync_file_range(-1, 0, 1, 2)
    assert e.value.errno == errno.EBADF
    with pytest.raises(OSError) as e:
        libc.prctl(-1, 0)
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        libc.madvise(mmap.PAGESIZE + 1, mmap.PAGESIZE, mmap.MADV_DONTNEED)  # not page-aligned
    assert e.value.errno == errno.EINVAL
