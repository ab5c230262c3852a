"""The drain's chunk work in child processes: :class:`ChunkWorkers` (``KNOBS.drain_processes``).

Why a process: the drain's threads, however low their priority, take the daemon's GIL between
their C calls (a read, a hash, each byte plane's zstd call: dozens of times per 8 MiB chunk).
On a busy node a ``SCHED_IDLE`` or nice-19 thread is preempted while it holds the GIL and does
not get a CPU back for milliseconds, and the event loop serving a save's BeginSave and
CommitSave waits for it: measured in-process (bench/README.md, issue 28), the loop's wake-up
latency rose from 0.2 ms to 3-4 ms (p90) and 12-20 ms (p99) while a drain ran, with the
encoding itself stubbed out as much as with it. A child process has its own GIL: its reads,
hashes and encodes, at ``SCHED_IDLE``, never hold up the daemon's threads; a drain thread
only sends a request and waits for the answer (the GIL released).

What crosses: descriptors, never paths (the daemon opens every shard through the local store's
no-follow checks and passes the descriptor with ``SCM_RIGHTS``); the encoded chunk comes back
in a shared ``memfd`` buffer owned by the daemon (no copy through a pipe, none under the GIL;
the child writes the stored form there directly, and the daemon accepts no length beyond
``size + 1``);
requests and answers are small JSON messages on a ``SOCK_SEQPACKET`` socket pair. One request
at a time per child; a drain thread holds a child from the request until it is done with the
answer (an encoded chunk: until it is uploaded). A child that dies is replaced; its request
fails with an ``OSError`` (the drain retries the rank like any local read error).

Children are started on first use (``python -m tierckptd.persistent._chunkmain``: no
multiprocessing, whose spawn would import the daemon's ``__main__``), at most one per codec slot
(``KNOBS.codec_threads``), and kept for the daemon's life (each holds numpy and zstandard, ~50
MiB, and one chunk buffer); they exit when the daemon's end of their socket closes, and are
killed with the daemon (:func:`die_with_parent`: one thread of the daemon starts them all).
While a save is open on the node they are stopped (:mod:`.pause`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tierckpt.errors import DataLossError

from ..knobs import KNOBS

__all__ = ["ChunkWorker", "ChunkWorkers", "encode_checked", "lower_priority", "serve"]

_MAX_MSG = 1 << 16
READY = b'{"ready": true}'
"""A child's first message (:meth:`ChunkWorker._ready`)."""
_START_TIMEOUT = 60.0
_SLACK = 32  # output bytes beyond a stored chunk's most (size + 1): at least .planeout.slack(4)

log = logging.getLogger(__name__)


class ChunkWorker:
    """One child process and the shared buffer its encoded chunks come back in."""

    def __init__(self, size: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        import tierckpt

        roots = [str(Path(__file__).resolve().parents[2]), str(Path(tierckpt.__file__).resolve().parents[1])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])}
        try:
            argv = [sys.executable, "-m", "tierckptd.persistent._chunkmain", str(theirs.fileno()), str(os.getpid())]
            self.proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                         close_fds=True)
        finally:
            theirs.close()
        self.sock = ours
        self._ready()
        self.out_fd = os.memfd_create("tierckpt-chunk", os.MFD_CLOEXEC)
        self.out_size = 0
        self.out: mmap.mmap | None = None
        self._fit(size)
        self.broken = False
        self.lifted = False  # at the normal policy for the chunk in progress (see _answer)
        self.lifts = 0
        self.can_lift = True  # false once the kernel refused a change of policy
        self.paused_seconds: Callable[[], float] = lambda: 0.0
        """Seconds the drain was paused in all (:meth:`.pause.DrainPause.paused_seconds`): a
        child stopped for a save is not starved, so that time does not count toward the grace."""

    def _ready(self) -> None:
        """Wait for the child's first message: it dies with the daemon from then on, so it may be
        stopped (:mod:`.pause`; one stopped before that would outlive a killed daemon).

        Raises:
            OSError: it exited or said something else (not used; the drain threads do the work).
        """
        try:
            self.sock.settimeout(_START_TIMEOUT)
            got = self.sock.recv(_MAX_MSG)
        except OSError as err:
            got = repr(err).encode()
        finally:
            self.sock.settimeout(None)
        if got != READY:
            self.sock.close()
            self.proc.kill()
            self.proc.wait()
            raise OSError(f"drain chunk worker did not start: {got[:200]!r}")

    def _fit(self, size: int) -> None:
        """The output buffer holds any stored chunk of ``size`` plain bytes (at most size + 1),
        and the raw layout of its byte planes while the child codes them (:mod:`.planeout`)."""
        need = size + 1 + _SLACK
        if self.out_size >= need:
            return
        if self.out is not None:
            self.out.close()
        os.ftruncate(self.out_fd, need)
        self.out_size = need
        self.out = mmap.mmap(self.out_fd, self.out_size)

    def call(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """One request and its answer (this thread blocks; the GIL is released while it waits).

        Raises:
            DataLossError: the child found the bytes damaged or changed.
            OSError: the child died or answered nonsense (it is not used again).
        """
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            raw = self._answer()
            if not raw:
                raise OSError(f"drain chunk worker {self.proc.pid} exited ({self.proc.poll()})")
            answer = json.loads(raw)
        except (OSError, ValueError) as err:
            self.broken = True
            raise OSError(f"drain chunk worker: {err}") from err
        if "dataloss" in answer:
            raise DataLossError(answer["dataloss"])
        if "error" in answer:
            self.broken = True
            raise OSError(f"drain chunk worker: {answer['error']}")
        return answer

    def _answer(self) -> bytes:
        """The child's answer. A child still at ``SCHED_IDLE`` after ``KNOBS.drain_idle_grace``
        seconds is starved by a busy node: it is lifted to the normal policy (still at nice
        19) until this chunk is done, so the drain always makes progress."""
        grace = KNOBS.drain_idle_grace
        if grace <= 0 or not self.can_lift:
            return self.sock.recv(_MAX_MSG)
        t0, p0 = time.monotonic(), self.paused_seconds()
        try:
            while (left := grace - (time.monotonic() - t0) + (self.paused_seconds() - p0)) > 0:
                self.sock.settimeout(left)
                try:
                    return self.sock.recv(_MAX_MSG)
                except TimeoutError:
                    continue  # the grace is over unless the drain was paused meanwhile
            self.lift(True)
            self.sock.settimeout(None)
            return self.sock.recv(_MAX_MSG)
        finally:
            self.sock.settimeout(None)
            self.lift(False)

    def lift(self, up: bool) -> None:
        """Put the child at the normal policy (``up``) or back at ``SCHED_IDLE`` (a no-op where it
        already is, or where the kernel refuses)."""
        if up == self.lifted:
            return
        policy = os.SCHED_OTHER if up else os.SCHED_IDLE
        try:
            os.sched_setscheduler(self.proc.pid, policy, os.sched_param(0))
        except (OSError, AttributeError) as err:  # said once: this child then waits for idle CPU
            log.warning("drain chunk worker %d: cannot change its scheduling policy (%s): on a busy node it "
                        "waits for idle CPU (RLIMIT_NICE >= 1 or CAP_SYS_NICE lets it be lifted)", self.proc.pid, err)
            self.can_lift = False
            return
        self.lifted = up
        if up:
            self.lifts += 1
            log.warning("drain chunk worker %d got no CPU for %.1f s at SCHED_IDLE (a busy node): it runs at "
                        "nice 19 until this chunk is done", self.proc.pid, KNOBS.drain_idle_grace)

    def hash(self, fd: int, offset: int, size: int, first: bool, checksum: str | None, what: str) -> str:
        """xxh3-128 of ``size`` bytes at ``offset``; the bytes also extend the shard checksum
        (begun anew where ``first``), checked against ``checksum`` when it is given (the last chunk)."""
        answer = self.call({"op": "hash", "offset": offset, "size": size, "first": first, "checksum": checksum,
                            "what": what}, [fd])
        return str(answer["digest"])

    def encode(self, fd: int, offset: int, size: int, digest: str, codec: str, what: str) -> memoryview:
        """The stored form of one chunk, read and checked against ``digest`` by the child; a view
        of this worker's buffer, valid until its next request."""
        self._fit(size)
        answer = self.call({"op": "encode", "offset": offset, "size": size, "digest": digest, "codec": codec,
                            "what": what}, [fd, self.out_fd])
        n = int(answer["stored"])
        if not 0 < n <= size + 1:
            self.broken = True
            raise OSError(f"drain chunk worker: {n} stored bytes for a chunk of {size}")
        assert self.out is not None
        return memoryview(self.out)[:n]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError, BufferError):
            if self.out is not None:
                self.out.close()
            os.close(self.out_fd)
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1.0)


_SPAWNER: list[cf.ThreadPoolExecutor] = []
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> cf.ThreadPoolExecutor:
    """The one thread that starts every child (for the process's life): a child dies with the
    thread that started it (:func:`die_with_parent`), and the drain's threads end when idle.

    The thread is started by the first caller, :class:`ChunkWorkers` as the tier is built (the
    daemon's thread, at the normal policy), never by a drain thread: a thread inherits its
    creator's ``SCHED_IDLE`` and nice 19, and so does a process, and a child's interpreter that
    starts at ``SCHED_IDLE`` on a node whose every core is busy got almost no CPU: its start
    timed out after a minute and the drain fell back to its threads. A child lowers itself once
    it is ready (``_chunkmain``). It is started with ``drain_processes=0`` too: the knob may be
    turned on later (tests do), and a thread started then would be a drain thread's child; an
    idle thread costs a stack's address space and no CPU."""
    with _SPAWNER_LOCK:
        if not _SPAWNER:
            pool = cf.ThreadPoolExecutor(1, thread_name_prefix="chunk-worker-start")
            pool.submit(int).result()  # its thread starts now, from this one
            _SPAWNER.append(pool)
        return _SPAWNER[0]


class ChunkWorkers:
    """Children kept between chunks and drains; :meth:`take` lends one to a drain thread."""

    def __init__(self) -> None:
        self._idle: list[ChunkWorker] = []
        self._all: list[ChunkWorker] = []
        self._lock = threading.Lock()
        self.failed = False
        """A child could not be started: the caller does the work itself from then on."""
        self.on_start: Callable[[int], None] | None = None
        """Called with each new child's pid before its first request (:meth:`.pause.DrainPause.adopt`)."""
        self.paused_seconds: Callable[[], float] = lambda: 0.0
        """Given to each child (:attr:`ChunkWorker.paused_seconds`)."""
        _spawner()  # its thread, started from this one (see there)

    @contextlib.contextmanager
    def take(self, size: int) -> Iterator[ChunkWorker]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
            if worker is not None and worker.proc.poll() is not None:  # died while idle: replaced, not used
                self._all.remove(worker)
                dead, worker = worker, None
            else:
                dead = None
        if dead is not None:
            dead.close()
        if worker is None:
            try:
                worker = _spawner().submit(ChunkWorker, size).result()
            except OSError as err:  # a sandbox that forbids memfd or a child: the drain threads do the work
                if not self.failed:
                    log.warning("drain chunk worker processes cannot start (%s): chunks are read and encoded on "
                                "the drain's threads", err)
                self.failed = True
                raise
            worker.paused_seconds = self.paused_seconds
            with self._lock:
                self._all.append(worker)
            if self.on_start is not None:
                self.on_start(worker.proc.pid)
        try:
            yield worker
        finally:
            with self._lock:
                if worker.broken:
                    self._all.remove(worker)
                else:
                    self._idle.append(worker)
            if worker.broken:
                worker.close()

    def pids(self) -> list[int]:
        """The children's process ids (tests)."""
        with self._lock:
            return [w.proc.pid for w in self._all]

    def close(self) -> None:
        """End every idle child (the tier stops; one still lent ends with the daemon)."""
        with self._lock:
            idle, self._idle = self._idle, []
            for w in idle:
                self._all.remove(w)
        for w in idle:
            w.close()


# ------------------------------------------------------------------------------------- the child

def encode_checked(data: memoryview, digest: str, codec: str, what: str, offset: int) -> bytes:
    """The stored form of a chunk read again from the local tier, once its bytes are checked
    against the ``digest`` the hash pass took (in a child process or on a drain thread).

    Raises:
        DataLossError: the local copy changed since it was hashed.
    """
    import xxhash

    from .compress import encode

    if xxhash.xxh3_128_hexdigest(data) != digest:
        raise DataLossError(f"{what}: the local copy changed while uploading (chunk at {offset}); not published")
    return encode(codec, data)


def die_with_parent(parent: int) -> None:
    """The child gets ``SIGKILL`` when the daemon thread that started it ends (a daemon killed
    while its children are stopped by :mod:`.pause` leaves none behind: a stopped process never
    reads the end of its socket), and exits now if the daemon is already gone."""
    from .. import libc

    with contextlib.suppress(OSError):
        libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def lower_priority() -> None:
    """The calling thread of the child at ``SCHED_IDLE`` and nice 19 (Linux sets both per thread;
    threads started afterwards inherit them, so it runs before numpy's imports start any): it
    runs only on CPUs nothing else wants. A child started by a drain thread at ``SCHED_IDLE``
    inherits it anyway; with ``drain_idle = 0`` numpy's thread was left at the normal policy."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


_PIECE = 1 << 18
"""Bytes a child reads at a time: each piece is hashed while it is still in the core's cache
(L2), so a chunk is read from memory once, not once per pass (issue 28 item 3)."""


class _Child:
    """The child's state: its read buffer, its mapping of the daemon's output buffer and the
    shard checksum of the hash pass in progress.

    Bytes touched per chunk (issue 28 item 3: the drain's memory traffic is what slows a save
    on the same node): the hash pass reads the chunk from the page cache once, a piece at a
    time into a buffer that stays in cache, and both hashes (the shard's checksum and the
    chunk's) take each piece there; the encode pass reads it once more into the chunk buffer,
    hashing each piece as it lands, and the codec writes its stored form straight into the
    daemon's shared buffer (:func:`.compress.encode_into`: no joined copy, no second copy). A
    ``bp*`` chunk (the float codecs) is not even gathered: each piece, still in cache, is split
    into its byte planes where they lie in the stored form (:mod:`.planeout`), so its bytes go
    through memory once on the way in and once on the way out, plus the coder's pass.
    """

    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None
        self.hasher: Any = None
        self.out: mmap.mmap | None = None
        self.out_id: tuple[int, int, int] | None = None

    def view(self, size: int) -> memoryview:
        if self.buf is None or len(self.buf) < size:
            if self.buf is not None:
                self.buf.close()
            self.buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return memoryview(self.buf)[:size]

    def pieces(self, fd: int, offset: int, size: int, what: str, keep: bool) -> Iterator[memoryview]:
        """The ``size`` bytes at ``offset``, read a whole piece (``_PIECE`` bytes, the last one
        shorter) at a time. ``keep``: each piece where it lies in the chunk buffer; else every
        piece in the same small buffer (used before the next is read)."""
        data = self.view(size if keep else min(size, _PIECE))
        pos = 0
        while pos < size:
            n = min(_PIECE, size - pos)
            piece, filled = (data[pos:pos + n] if keep else data[:n]), 0
            while filled < n:
                got = os.preadv(fd, [piece[filled:]], offset + pos + filled)
                if got <= 0:
                    raise DataLossError(f"{what}: the local file ends at {offset + pos + filled} (a chunk of "
                                        f"{size} at {offset})")
                filled += got
            yield piece
            pos += n

    def read(self, fd: int, offset: int, size: int, what: str, hashers: list[Any], keep: bool) -> memoryview:
        """Read ``size`` bytes at ``offset`` (:meth:`pieces`), each piece given to every hasher
        right after it is read (still in cache); ``keep``: returned whole, from the chunk buffer."""
        for piece in self.pieces(fd, offset, size, what, keep):
            for h in hashers:
                h.update(piece)
        return self.view(size) if keep else memoryview(b"")

    def hash(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        import xxhash
        from tierckpt.common import checksum as _checksum

        if req["first"] or self.hasher is None:
            self.hasher = _checksum.new()
        digest = xxhash.xxh3_128()  # the same digest as xxh3_128_hexdigest of the whole chunk
        self.read(fds[0], int(req["offset"]), int(req["size"]), str(req["what"]), [self.hasher, digest], keep=False)
        if req["checksum"] is not None and self.hasher.hexdigest() != req["checksum"]:
            raise DataLossError(f"{req['what']}: the local copy does not match its checksum while uploading "
                                f"(expected {req['checksum']}, read {self.hasher.hexdigest()}); not published")
        return {"digest": digest.hexdigest()}

    def output(self, fd: int) -> mmap.mmap:
        """The daemon's output buffer (its memfd, sent with each request), mapped once and kept
        while it is the same file of the same size (no new mapping to fault in per chunk)."""
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size)
        if self.out is None or self.out_id != ident:
            if self.out is not None:
                with contextlib.suppress(BufferError):  # a view still held: unmapped when collected
                    self.out.close()
            self.out, self.out_id = None, None
            self.out = mmap.mmap(fd, 0)
            self.out_id = ident
        return self.out

    def encode(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        import xxhash

        from .compress import encode_into

        size, what, offset, codec = int(req["size"]), str(req["what"]), int(req["offset"]), str(req["codec"])
        digest, out = xxhash.xxh3_128(), self.output(fds[1])
        writer = _plane_writer(codec, size, out)
        if writer is not None:  # each piece split into its planes while in cache (:mod:`.planeout`)
            for piece in self.pieces(fds[0], offset, size, what, keep=False):
                digest.update(piece)
                writer.put(piece)
            _check(digest, req)
            return {"stored": writer.finish()}
        data = self.read(fds[0], offset, size, what, [digest], keep=True)
        _check(digest, req)  # the bytes encoded are the bytes just hashed
        return {"stored": encode_into(codec, data, out)}


def _plane_writer(codec: str, size: int, out: mmap.mmap) -> Any:
    """A :class:`.planeout.PlaneWriter` for a ``bp*`` chunk, or None (another codec, or no libblosc2)."""
    from .planeout import WIDTHS, PlaneWriter

    width = WIDTHS.get(codec)
    if width is None:
        return None
    try:
        return PlaneWriter(width, size, out)
    except ValueError:
        return None


def _check(digest: Any, req: dict[str, Any]) -> None:
    if digest.hexdigest() != str(req["digest"]):
        raise DataLossError(f"{req['what']}: the local copy changed while uploading (chunk at {req['offset']}); "
                            "not published")


def serve(sock: socket.socket) -> None:
    """Answer requests until the daemon's end closes (every error is answered, never raised:
    the daemon turns it into the drain's error)."""
    lower_priority()
    child = _Child()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 2)
        except OSError:
            return
        if not msg:
            return
        answer: dict[str, Any]
        try:
            req = json.loads(msg)
            op = {"hash": child.hash, "encode": child.encode}[req["op"]]
            answer = op(req, fds)
        except DataLossError as err:
            answer = {"dataloss": str(err)}
        except Exception as err:  # process boundary: the daemon gets it as an OSError
            answer = {"error": repr(err)}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            sock.send(json.dumps(answer).encode())
        except OSError:
            return
