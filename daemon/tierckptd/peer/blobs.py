"""Read tickets for one file that is not a rank's shard (an XOR parity slot), served over the
bulk channel as shard ``"slot"``: a restoring node pulls the slot and decodes the chunk itself.

The ticket holds the file open from the moment it is issued, so the bytes served are those the
slot had when its size and checksum were described (a slot replaced since is a different
file). Like a rank's read ticket it serves each byte once and ends when every byte was served,
or ``KNOBS.read_ticket_ttl`` after its last use; then the file is closed.

A ticket may be issued for a file still being written (a chunk a protector is decoding for a
restoring node, :mod:`..parity.farside`) with a :class:`Progress`: its bytes are served as they
are written, in order, so the decode and the transfer overlap instead of following each other.
The last bytes are held back until the writer declares the file complete (its checks passed);
a writer that fails, or stalls past ``bulk.IO_TIMEOUT``, cuts the stream short, and the reader
sees a connection that ended early, never bytes the writer disowned.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierckpt.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError

from ..knobs import KNOBS
from . import bulk

__all__ = ["BLOB_SHARD", "BlobTickets", "Progress"]

BLOB_SHARD = "slot"
MAX_TICKETS = 4096
"""Open blob tickets at most (each holds a descriptor): past it the oldest is dropped."""


HOLD_BACK = 256 << 10
"""Bytes at the end of a blob being written that are served only once it is complete."""


class Progress:
    """How much of a blob being written may be served: written in any order (``wrote``), served
    in order up to the contiguous written prefix, all but the last ``HOLD_BACK`` bytes until
    ``finish`` (thread-safe: decode workers write, bulk threads wait)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ready = 0
        self._pending: dict[int, int] = {}
        self._final = False
        self._failed: str | None = None
        self._cond = threading.Condition()

    def wrote(self, at: int, n: int) -> None:
        with self._cond:
            self._pending[at] = n
            while self._ready in self._pending:
                self._ready += self._pending.pop(self._ready)
            self._cond.notify_all()

    def finish(self) -> None:
        """Every byte is written and checked: serve the rest."""
        with self._cond:
            if self._ready != self.size:
                self._failed = f"finished with {self._ready} of {self.size} bytes written"
            self._final = True
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        with self._cond:
            self._failed = why
            self._cond.notify_all()

    def _visible(self) -> int:
        return self.size if self._final else min(self._ready, self.size - min(self.size, HOLD_BACK))

    def wait_past(self, pos: int, timeout: float) -> int:
        """Block until bytes past ``pos`` may be served; how many may (in all, from 0).

        Raises:
            UnavailableError: the writer failed, or wrote nothing more for ``timeout`` seconds.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._failed is not None or self._visible() > pos, timeout)
            if self._failed is not None:
                raise UnavailableError(f"the blob being served could not be written: {self._failed}")
            visible = self._visible()
            if visible <= pos:
                raise UnavailableError(f"the blob being served stalled at {pos} of {self.size} bytes")
            return visible


STREAM_STEP = 4 << 20
"""Most bytes sent at once from a blob being written (then its progress is looked at again)."""


@dataclass(eq=False)
class _Blob:
    fd: int
    size: int
    requester: str
    progress: Progress | None = None
    used: float = field(default_factory=time.monotonic)
    served: list[tuple[int, int]] = field(default_factory=list)  # disjoint [start, end)
    left: int = 0
    on_close: Callable[[], None] | None = None
    readers: int = 0  # serves holding a descriptor of the file
    dropped: bool = False


class BlobTickets:
    """Blob tickets of one daemon (thread-safe: bulk threads serve them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blobs: dict[str, _Blob] = {}

    def issue(self, fd: int, size: int, requester: str, progress: Progress | None = None,
              on_close: Callable[[], None] | None = None) -> str:
        """A ticket for ``size`` bytes of ``fd``; the ticket owns ``fd`` from now on. With
        ``progress``, the file is still being written: bytes are served as it allows.
        ``on_close()`` is called once when the ticket ended (spent, expired or dropped) and no
        serve of it holds the file any more (a decoded chunk's room is given back then)."""
        ticket = secrets.token_urlsafe(18)
        with self._lock:
            if len(self._blobs) >= MAX_TICKETS:
                self._drop(min(self._blobs, key=lambda t: self._blobs[t].used))
            self._blobs[ticket] = _Blob(fd, size, requester, progress, left=max(1, size), on_close=on_close)
        return ticket

    def holds(self, ticket: str) -> bool:
        with self._lock:
            return ticket in self._blobs

    def take(self, ticket: str, shard: str, ranges: list[tuple[int, int]]) -> tuple[int, str]:
        """Claim ``ranges`` of the ticket's file: a new descriptor of it (the caller closes it, then
        calls :meth:`read_done`) and the node the ticket was issued to.

        Raises:
            FailedPreconditionError: unknown, expired or spent ticket, or bytes served already.
            InvalidArgumentError: not the ticket's shard name.
        """
        if shard != BLOB_SHARD:
            raise InvalidArgumentError(f"shard: {shard!r} is not part of this ticket (it serves {BLOB_SHARD!r})")
        now = time.monotonic()
        with self._lock:
            b = self._blobs.get(ticket)
            if b is not None and now - b.used > KNOBS.read_ticket_ttl:
                self._drop(ticket)
                b = None
            if b is None:
                raise FailedPreconditionError("ticket: unknown, expired or spent slot ticket")
            for start, length in ranges:
                end = start + max(1, length)
                if any(s < end and start < e for s, e in b.served):
                    raise FailedPreconditionError(f"ticket: bytes of the slot at {start} were already read with "
                                                  "this ticket")
            b.served.extend((s, s + max(1, n)) for s, n in ranges)
            b.left -= sum(max(1, n) for _, n in ranges)
            b.used = now
            fd = os.dup(b.fd)
            b.readers += 1  # until the caller's read_done()
            if b.left <= 0:
                self._drop(ticket)
            return fd, b.requester

    def describe(self, ticket: str) -> tuple[int, str]:
        """(size, requester) of a live ticket (FailedPreconditionError otherwise)."""
        b = self._live(ticket)
        return b.size, b.requester

    def _live(self, ticket: str) -> _Blob:
        with self._lock:
            b = self._blobs.get(ticket)
            if b is None:
                raise FailedPreconditionError("ticket: unknown, expired or spent slot ticket")
            return b

    def serve(self, sock: socket.socket, ticket: str, shard: str, piece: tuple[Any, Any, Any], buf: bytearray,
              check_holder: Callable[[socket.socket, str], None]) -> None:
        """Serve one bulk "get" of a blob ticket (a bulk thread): the connection must be the
        requester's (``check_holder``), the piece must fit the file, each byte is served once."""
        b = self._live(ticket)
        check_holder(sock, b.requester)
        bulk.check_piece(*piece, b.size)
        ranges = list(bulk.runs(*piece, b.size))
        fd, _ = self.take(ticket, shard, ranges)
        try:
            with os.fdopen(fd, "rb") as fh:
                self._send(sock, b, fh, ranges, buf)
        finally:
            self.read_done(b)

    def read_done(self, b: _Blob) -> None:
        """A reader of :meth:`take` closed its descriptor."""
        with self._lock:
            b.readers -= 1
            self._closed_locked(b)

    @staticmethod
    def _send(sock: socket.socket, b: _Blob, fh: Any, ranges: list[tuple[int, int]], buf: bytearray) -> None:
        bulk.send_msg(sock, {"ok": True, "length": sum(n for _, n in ranges)})
        for start, length in ranges:
            if b.progress is None:
                bulk.send_range(sock, fh, start, length, buf)
                continue
            pos, end = start, start + length
            while pos < end:  # as the writer allows
                try:
                    upto = min(end, b.progress.wait_past(pos, bulk.IO_TIMEOUT), pos + STREAM_STEP)
                except UnavailableError as e:
                    # mid-stream: no error reply (the reader would take it for data), the
                    # connection is closed short instead (an OSError, not answered)
                    raise ConnectionAbortedError(str(e)) from None
                bulk.send_range(sock, fh, pos, upto - pos, buf)
                pos = upto

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for t in [t for t, b in self._blobs.items() if now - b.used > KNOBS.read_ticket_ttl]:
                self._drop(t)

    def close(self) -> None:
        with self._lock:
            for t in list(self._blobs):
                self._drop(t)

    def _drop(self, ticket: str) -> None:
        b = self._blobs.pop(ticket, None)
        if b is not None:
            os.close(b.fd)
            b.dropped = True
            self._closed_locked(b)

    @staticmethod
    def _closed_locked(b: _Blob) -> None:
        if b.dropped and b.readers <= 0 and b.on_close is not None:
            fn, b.on_close = b.on_close, None
            fn()
