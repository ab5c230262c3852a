"""Verify the bytes of a shard as they are uploaded: :class:`VerifyingReader`.

The drain reads a committed shard through the local store's no-follow descriptor and hands the
backend this reader instead of a path. Every byte the backend reads is hashed in file order (a
backend that seeks back to re-send a part re-reads bytes already hashed; they are not hashed
twice), and the read that completes the shard raises :class:`DataLossError` when the checksum
differs from the manifest's, so the backend aborts the put before the object is published (a
file rename, an S3 multipart completion, a GCS final chunk). :meth:`check` repeats the test after
the put for backends that read everything before sending.
"""

from __future__ import annotations

import io
import os

from tierckpt.common import checksum as _checksum
from tierckpt.errors import DataLossError

__all__ = ["VerifyingReader"]


class VerifyingReader(io.RawIOBase):
    """A read-only, seekable file object over ``fd`` that verifies the shard's checksum.

    Args:
        fd: an open descriptor of the shard (not closed here).
        size: the shard's size per its manifest.
        expected: the shard's checksum per its manifest.
        what: names the shard in errors.
    """

    def __init__(self, fd: int, size: int, expected: str, what: str) -> None:
        super().__init__()
        self._fd = fd
        self.size = size
        self._expected = expected
        self._what = what
        self._pos = 0
        self._hashed = 0
        self._hasher = _checksum.new()
        self._verified = size == 0 and _checksum.digest(b"") == expected

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: bytearray | memoryview) -> int:  # type: ignore[override]
        want = min(len(buf), self.size - self._pos)
        if want <= 0:
            return 0
        with memoryview(buf).cast("B")[:want] as data:  # read in place, the GIL released (no copy, no new pages)
            got = os.preadv(self._fd, [data], self._pos)
            if got < want:
                raise DataLossError(f"{self._what}: the local file ends at {self._pos + got} of {self.size} bytes")
            start = self._pos
            self._pos += got
            if start <= self._hashed < self._pos:  # extend the hashed prefix, in file order only
                self._hasher.update(data[self._hashed - start:])
                self._hashed = self._pos
                if self._hashed == self.size:
                    self._verify()
        return got

    def _verify(self) -> None:
        actual = self._hasher.hexdigest()
        if actual != self._expected:
            raise DataLossError(f"{self._what}: the local copy does not match its checksum while uploading "
                                f"(expected {self._expected}, read {actual}); not published")
        self._verified = True

    def check(self) -> None:
        """Raise DataLossError unless every byte was read and matched the checksum."""
        if not self._verified:
            if self._hashed < self.size:
                raise DataLossError(f"{self._what}: only {self._hashed} of {self.size} bytes were read for upload")
            self._verify()
