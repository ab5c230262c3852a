"""The bulk data channel between daemons: framed requests on TCP (TLS-wrapped under mTLS).

gRPC carries the control messages of the peer tier; shard bytes travel here, because gRPC byte
streaming reaches about a third of a raw socket's throughput. One connection serves any number
of requests in turn; a transfer opens several connections to move pieces in parallel.

A piece is a strided set of runs of one shard: bytes ``[offset + i*stride, offset + i*stride +
chunk)`` for i = 0, 1, ... (clipped to the shard's size); a whole shard is one run
(``offset=0, chunk=stride=size``). Splitting a shard into k pieces of interleaved 4 MiB chunks
lets k connections carry it while the receiver hashes it in byte order as it arrives
(:class:`OrderedHasher`): the checksum is verified on receipt without a second pass.

Wire format (all integers big-endian)::

    message  := u32 length | JSON object (at most 64 KiB)
    request  := message {"v": 1, "op": "put" | "get", "ticket": str, "shard": str,
                         "offset": int, "chunk": int, "stride": int}

    put  client -> request;   server -> {"ok": true} or an error
         client -> the piece's bytes, run after run (sendfile: zero-copy from the local tier)
         server -> {"ok": true} once they are written, else an error
    get  client -> request;   server -> {"ok": true, "length": n} or an error
         server -> the piece's n bytes (sendfile)

An error is ``{"ok": false, "code": "<grpc.StatusCode name>", "error": "<message>"}``; the
server closes the connection after one. Tickets (random, issued over the authenticated gRPC
channel) authorise each request; with TLS configured both ends also present CA-signed
certificates. Everything here is blocking and runs in worker threads, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from tierckpt.common import checksum as _checksum
from tierckpt.common import status as _status
from tierckpt.common.fileio import pwrite_all
from tierckpt.errors import CapacityError, InvalidArgumentError, TierckptError, UnavailableError

from ..knobs import KNOBS

__all__ = [
    "BUF_BYTES",
    "CHUNK",
    "BulkServer",
    "OrderedHasher",
    "check_piece",
    "connect",
    "error_msg",
    "raise_for",
    "recv_msg",
    "recv_range",
    "discard",
    "runs",
    "send_msg",
    "send_range",
]

log = logging.getLogger(__name__)

VERSION = 1
MAX_HEADER = 64 << 10
BUF_BYTES = 4 << 20
"""Receive buffer per connection: bytes are written to the file and hashed in pieces of this size."""
CHUNK = BUF_BYTES
"""Run length of a split shard's pieces (one receive buffer, hashed while still in cache)."""
IO_TIMEOUT = 60.0
"""Seconds a blocked send or receive waits before the transfer is abandoned."""
MIN_CHUNK = 1 << 20
"""Smallest run a piece may ask for (unless the shard's rest is smaller): degenerate pieces
(chunk = stride = 1) would cost a system call per byte."""
_LEN = struct.Struct(">I")


def send_msg(sock: socket.socket, obj: dict) -> None:
    """Send one framed JSON message."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("bulk connection closed by the peer")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket, *, eof_ok: bool = False) -> dict | None:
    """Receive one framed JSON message; None at a clean end of stream when ``eof_ok``."""
    first = sock.recv(_LEN.size)
    if not first:
        if eof_ok:
            return None
        raise ConnectionError("bulk connection closed by the peer")
    head = first + (_recv_exact(sock, _LEN.size - len(first)) if len(first) < _LEN.size else b"")
    (n,) = _LEN.unpack(head)
    if n > MAX_HEADER:
        raise ConnectionError(f"bulk message of {n} bytes exceeds {MAX_HEADER}")
    try:
        obj = json.loads(_recv_exact(sock, n))
    except ValueError as e:
        raise ConnectionError(f"malformed bulk message: {e}") from None
    if not isinstance(obj, dict):
        raise ConnectionError("malformed bulk message: not an object")
    return obj


def error_msg(exc: TierckptError) -> dict:
    """The error reply for a tierckpt exception."""
    return {"ok": False, "code": _status.code_for(exc).name, "error": str(exc)}


def raise_for(reply: dict, what: str) -> dict:
    """Return an ok reply; raise the matching tierckpt exception for an error reply."""
    if reply.get("ok"):
        return reply
    code = getattr(grpc.StatusCode, str(reply.get("code")), grpc.StatusCode.INTERNAL)
    raise _status.error_for_code(code, f"{what}: {reply.get('error', 'failed')}")


def runs(offset: int, chunk: int, stride: int, size: int) -> Iterator[tuple[int, int]]:
    """The ``(start, length)`` runs of a piece of a ``size``-byte shard (see the module docstring)."""
    if size == 0:
        yield 0, 0
        return
    for start in range(offset, size, stride):
        yield start, min(chunk, size - start)


def check_piece(offset: int, chunk: int, stride: int, size: int) -> None:
    """Raise InvalidArgumentError unless the piece fits a ``size``-byte shard."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, chunk, stride)):
        raise InvalidArgumentError("offset/chunk/stride: must be integers")
    if size and not (0 <= offset < size and 1 <= chunk <= stride):
        raise InvalidArgumentError(f"offset/chunk/stride: {offset}/{chunk}/{stride} do not fit a {size}-byte shard")
    if size and chunk < min(MIN_CHUNK, size - offset):  # tiny runs cost a message each: refuse them
        raise InvalidArgumentError(f"chunk: {chunk} bytes is below the minimum run of {MIN_CHUNK} bytes")


class OrderedHasher:
    """The checksum of one shard, fed in byte order while several connections receive its pieces.

    A receiving thread calls :meth:`update` with each buffer it wrote; it waits until every
    earlier byte was hashed (the pieces interleave, so waits are short), hashes its buffer while
    it is still in cache, and lets the next one go.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.pos = 0
        self._h = _checksum.new()
        self._cv = threading.Condition()
        self._error = ""

    def update(self, offset: int, data) -> None:
        """Hash ``data``, which starts at ``offset``, once every byte before it was hashed.

        Raises:
            ConnectionError: the transfer was aborted, or an earlier piece stalled.
        """
        with self._cv:
            if not self._cv.wait_for(lambda: self.pos == offset or self._error, timeout=IO_TIMEOUT):
                raise ConnectionError(f"bulk transfer stalled: byte {offset} waited for byte {self.pos}")
            if self._error:
                raise ConnectionError(self._error)
            self._h.update(data)
            self.pos += len(data)
            self._cv.notify_all()

    def abort(self, reason: str) -> None:
        """Fail every waiting and future :meth:`update` (another connection of the transfer broke)."""
        with self._cv:
            self._error = self._error or reason
            self._cv.notify_all()

    @property
    def complete(self) -> bool:
        return self.pos == self.size and not self._error

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def recv_range(sock: socket.socket, fd: int, offset: int, length: int, buf: bytearray,
               on_data: Callable[[int, memoryview], None] | None = None,
               pause: Callable[[], None] | None = None, *, keep_in_step: bool = False) -> None:
    """Receive ``length`` bytes into ``fd`` at ``offset`` through ``buf``.

    Args:
        on_data: called with (file offset, bytes) for each buffer written (hashing).
        pause: called before each buffer is received; it may block to give way to more urgent
            transfers (TCP flow control then holds the sender back).
        keep_in_step: when writing fails (a full local dir), receive the rest of the range
            anyway before raising, so the connection can still carry an error reply.

    Raises:
        ConnectionError: the stream ended early.
        OSError: writing ``fd`` failed.
    """
    try:
        _recv_range(sock, fd, offset, length, buf, on_data, pause)
    except _WriteFailed as e:
        if keep_in_step:
            discard(sock, length - e.received, buf)
        raise e.error from None


class _WriteFailed(Exception):
    def __init__(self, error: OSError, received: int) -> None:
        self.error, self.received = error, received


def discard(sock: socket.socket, length: int, buf: bytearray) -> None:
    """Receive and drop ``length`` bytes (keeps a stream in step after a failed write).

    Raises:
        ConnectionError: the stream ended early.
    """
    view = memoryview(buf)
    while length > 0:
        k = sock.recv_into(view[:min(len(view), length)])
        if not k:
            raise ConnectionError(f"bulk stream ended with {length} bytes still to come")
        length -= k


def _recv_range(sock: socket.socket, fd: int, offset: int, length: int, buf: bytearray,
                on_data: Callable[[int, memoryview], None] | None,
                pause: Callable[[], None] | None) -> None:
    view = memoryview(buf)
    done = 0
    while done < length:
        if pause is not None:
            pause()
        want = min(len(view), length - done)
        got = 0
        while got < want:  # fill the buffer: TLS returns one record (16 KiB) per call
            k = sock.recv_into(view[got:want])
            if not k:
                raise ConnectionError(f"bulk stream ended after {done + got} of {length} bytes")
            got += k
        chunk = view[:got]
        try:
            pwrite_all(fd, chunk, offset + done)
        except OSError as e:
            raise _WriteFailed(e, done + got) from None
        if on_data is not None:
            on_data(offset + done, chunk)
        done += got


def send_range(sock: socket.socket, fh, offset: int, length: int, buf: bytearray | None = None) -> None:
    """Send ``length`` bytes of the open file ``fh`` from ``offset``: zero-copy sendfile on plain
    TCP, large reads and ``sendall`` under TLS (Python's fallback sends 8 KiB blocks)."""
    if length == 0:
        return
    if not isinstance(sock, ssl.SSLSocket):
        sent = sock.sendfile(fh, offset, length)
        if sent != length:
            raise ConnectionError(f"sent {sent} of {length} bytes (file shorter than its manifest?)")
        return
    view = memoryview(buf if buf is not None else bytearray(BUF_BYTES))
    fd = fh.fileno()
    done = 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(view), length - done)]], offset + done)
        if not n:
            raise ConnectionError(f"file ended after {done} of {length} bytes")
        sock.sendall(view[:n])
        done += n


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(host: str, port: int, ssl_context: ssl.SSLContext | None, server_hostname: str | None = None,
            timeout: float = 10.0) -> socket.socket:
    """Open a bulk connection (TLS handshake included when ``ssl_context`` is given).

    Raises:
        UnavailableError: the peer cannot be reached or refused the handshake.
    """
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise UnavailableError(f"bulk channel {host}:{port}: {e.strerror or e}") from None
    _tune(sock)
    if ssl_context is not None:
        try:
            sock = ssl_context.wrap_socket(sock, server_hostname=server_hostname or host)
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raise UnavailableError(f"bulk channel {host}:{port}: TLS handshake failed: {e}") from None
    sock.settimeout(IO_TIMEOUT)
    return sock


Handler = Callable[[socket.socket, dict, bytearray], None]
"""``handler(sock, request, buf)`` serves one request; raising closes the connection."""


class _Conn:
    """One accepted bulk connection, as the server tracks it."""

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock  # replaced by the TLS socket once wrapped
        self.source = source
        self.since = time.monotonic()
        self.authed = False
        self.info: object = None  # what ``authenticate`` returned

    def cut(self) -> None:
        """Shut the connection down from another thread (its serving thread then ends)."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the fd only: never the TLS object
        except OSError:
            pass


class BulkServer:
    """Accepts bulk connections and serves their requests, one thread per connection.

    Two pools, so that connections that have not authenticated never take a peer's slot:

    - **unauthenticated**: every accepted connection until it is authenticated (under TLS: the
      handshake done and ``authenticate`` accepted the certificate; without TLS: its first
      request header arrived). At most ``KNOBS.bulk_max_unauthenticated``; one more closes the
      oldest of them. Each has ``KNOBS.bulk_first_request_timeout`` seconds in all (handshake
      and first header), then it is closed.
    - **authenticated**: at most ``KNOBS.bulk_max_connections``, ``KNOBS.bulk_max_per_source``
      from one address; beyond, the connection is answered RESOURCE_EXHAUSTED and closed. One
      idle between requests for ``KNOBS.bulk_idle_timeout`` is closed.

    ``still_valid(info)`` is asked about every authenticated connection about twice a second
    (a revoked certificate, a CA change): False closes it at once. The transfer buffer is
    allocated only once a valid request arrived.

    Args:
        host: address to bind ("" for every interface).
        ssl_context: server-side TLS context (requires client certificates), or None.
        handler: serves one request (see :data:`Handler`).
        authenticate: under TLS, ``authenticate(tls_socket) -> info`` after the handshake; it
            raises a TierckptError to refuse (answered, then closed).
        still_valid: ``still_valid(info) -> bool`` for open authenticated connections.
    """

    def __init__(self, host: str, ssl_context: ssl.SSLContext | None, handler: Handler,
                 authenticate: Callable[[socket.socket], object] | None = None,
                 still_valid: Callable[[object], bool] | None = None) -> None:
        self.host = host
        self.ssl_context = ssl_context
        self.handler = handler
        self.authenticate = authenticate
        self.still_valid = still_valid
        self.port = 0
        self._lock = threading.Lock()
        self._pending: set[_Conn] = set()
        self._authed: set[_Conn] = set()
        self._by_source: dict[str, int] = {}
        self.refused = 0
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._swept = 0.0

    def start(self, port: int = 0) -> int:
        """Bind, listen and start accepting; returns the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        sock.listen(128)
        sock.settimeout(0.25)
        self._sock, self.port = sock, sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="tierckpt-bulk-accept", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop accepting (connections being served finish on their own)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._sock is not None:
            self._sock.close()

    def counts(self) -> tuple[int, int]:
        """(unauthenticated, authenticated) connections open now."""
        with self._lock:
            return len(self._pending), len(self._authed)

    def _admit(self, c: _Conn) -> None:
        with self._lock:
            if len(self._pending) >= KNOBS.bulk_max_unauthenticated:
                oldest = min(self._pending, key=lambda o: o.since)
                self._pending.discard(oldest)
                self.refused += 1
                log.warning("bulk channel: closed an unauthenticated connection from %s to make room",
                            oldest.source)
                oldest.cut()
            self._pending.add(c)

    def _promote(self, c: _Conn) -> bool:
        with self._lock:
            self._pending.discard(c)
            if len(self._authed) >= KNOBS.bulk_max_connections or \
                    self._by_source.get(c.source, 0) >= KNOBS.bulk_max_per_source:
                self.refused += 1
                return False
            c.authed = True
            self._authed.add(c)
            self._by_source[c.source] = self._by_source.get(c.source, 0) + 1
            return True

    def _release(self, c: _Conn) -> None:
        with self._lock:
            self._pending.discard(c)
            if c in self._authed:
                self._authed.discard(c)
                left = self._by_source.get(c.source, 1) - 1
                if left:
                    self._by_source[c.source] = left
                else:
                    self._by_source.pop(c.source, None)

    def _sweep(self) -> None:
        """Close unauthenticated connections past their deadline and authenticated ones no longer valid."""
        now = time.monotonic()
        if now - self._swept < 0.25:
            return
        self._swept = now
        with self._lock:
            late = [c for c in self._pending if now - c.since > KNOBS.bulk_first_request_timeout]
            authed = list(self._authed)
        for c in late:
            log.info("bulk channel: connection from %s closed: no request in time", c.source)
            c.cut()
        if self.still_valid is None:
            return
        for c in authed:
            try:
                valid = self.still_valid(c.info)
            except Exception:  # never let a check kill the accept loop
                log.exception("bulk channel: re-checking a connection failed; closing it")
                valid = False
            if not valid:
                log.warning("bulk channel: closed the connection from %s: its certificate was revoked or the TLS "
                            "files changed", c.source)
                c.cut()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            self._sweep()
            try:
                conn, addr = self._sock.accept()  # type: ignore[union-attr]  # set by start()
            except TimeoutError:
                continue
            except OSError as e:
                if not self._stopping.is_set():
                    log.error("bulk channel: accept failed: %s", e)
                return
            c = _Conn(conn, addr[0])
            self._admit(c)
            threading.Thread(target=self._serve, args=(c,), name="tierckpt-bulk", daemon=True).start()

    def _serve(self, c: _Conn) -> None:
        conn = c.sock
        try:
            conn.settimeout(KNOBS.bulk_first_request_timeout)
            _tune(conn)
            if self.ssl_context is not None:
                conn = c.sock = self.ssl_context.wrap_socket(conn, server_side=True)
                if self.authenticate is not None:
                    try:
                        c.info = self.authenticate(conn)
                    except TierckptError as e:
                        log.warning("bulk channel: refused %s: %s", c.source, e)
                        send_msg(conn, error_msg(e))
                        return
                if not self._promote(c):
                    send_msg(conn, error_msg(CapacityError("bulk channel: connection limit reached")))
                    return
            buf: bytearray | None = None
            while not self._stopping.is_set():
                req = recv_msg(conn, eof_ok=True)
                if req is None:
                    return
                if not c.authed and not self._promote(c):  # plain TCP: a first request authenticates
                    send_msg(conn, error_msg(CapacityError("bulk channel: connection limit reached")))
                    return
                if req.get("v") != VERSION:
                    send_msg(conn, {"ok": False, "code": "INVALID_ARGUMENT", "error": f"bulk version {req.get('v')!r}"})
                    return
                conn.settimeout(IO_TIMEOUT)
                buf = buf if buf is not None else bytearray(BUF_BYTES)
                self.handler(conn, req, buf)
                conn.settimeout(KNOBS.bulk_idle_timeout)
        except ssl.SSLError as e:
            log.warning("bulk channel: refused %s: %s", c.source, e)
        except TimeoutError:
            log.info("bulk channel: connection from %s closed: no request in time", c.source)
        except (OSError, TierckptError) as e:
            log.warning("bulk channel: connection from %s ended: %s", c.source, e)
        except Exception:  # thread boundary: log, never kill the daemon
            log.exception("bulk channel: request from %s failed", c.source)
        finally:
            conn.close()
            self._release(c)
