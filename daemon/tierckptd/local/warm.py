"""Warm pages ahead of need: pre-allocated files in the recycle pool, and staging files allocated
ahead of their writer.

A write into a fresh tmpfs page first allocates it (the "first-touch" cost the recycle pool
avoids in the steady state). Two cases are still cold: the first saves of a job (nothing was
evicted yet) and the first replica or restore a node receives. The :class:`Warmer` covers them
by allocating a file's pages ahead of its writer without changing its bytes (how: below):

- *Pool top-up* (a background thread at the lowest CPU priority, which also waits between
  chunks while the node is busy: a save open or committing here, a trainer's, an inbound copy's
  or a restore's, or a peer transfer reading from here): after every commit the store
  works out the shard sizes the coming saves of each job held here will need (those of its newest
  step's ranks on this node, once per save until the job holds keep_local + 1 steps and starts
  recycling, and for ranks held as copies until they hold keep_local, since the owner drops a
  copy before it pushes the next; not for a job with a save open, whose commit will hand the pool
  the files of the step it evicts) and adds pre-allocated files of the missing sizes to the recycle
  pool, but only into free capacity: warming never evicts anything, and warm files are pool files
  (charged like them, dropped first when a save needs room, released after the idle timeout).
  A warm file taken by a save before it is fully allocated is left as it is: its writer
  allocates the rest (finishing it ahead of a local trainer's writes was measured to slow the
  save down: both contend for the file's lock and the CPU).
  Measured before this rule (the 1 GiB top-up that a commit asks for ran during that step's
  replication, in the same process): replication round 1 took 0.55-2.3 s instead of 0.36-0.45 s.
- *Hinted pool files* (the same background thread): the sizes of a peer's coming first copy of
  one of its ranks, sent by the owner when its trainer begins the save (:mod:`tierckptd.peer.hints`),
  become pool files the copy then takes like recycled ones; same rules (free capacity only,
  charged as pool files, dropped first). On by default on tmpfs (``KNOBS.warm_hint``): it runs
  once per rank and peer, never in the steady state, where the copy recycles the evicted one's files.
- *Prefault* (an urgent thread at normal priority): the staging files of an inbound replica or a
  restore that the pool could not cover are allocated front to back while the bytes arrive (the
  bulk receive writes each piece at increasing offsets), so allocation overlaps the transfer.
  Always with fallocate: touching pages just ahead of their writer was measured slower (a node
  replacement's restore of 1 GiB, median 4.7 s against 3.1 s, in a VM where touching is the
  pool's default: both threads then fault the same file's pages in). That was measured while
  :func:`touch_pages` still held the GIL for each chunk (until 2026-12-07), which stalled the
  receiving thread too; not measured again since.

How a page is allocated (``KNOBS.warm_touch``): ``fallocate(FALLOC_FL_KEEP_SIZE)`` allocates it
without writing it; :func:`touch_pages` (``MADV_POPULATE_WRITE``) also writes it (zeroes it).
On bare metal both leave the writer only its copy. In a VM whose kernel reports free memory
to the hypervisor (free page reporting), a page allocated again is backed by the host only on
its first write, which costs 3-4.5 s per GiB under nested virtualisation (bench/pages.py): there
only touched pages are warm, and touching is the default for pool files (prefault ahead of a
writer always fallocates: see above).

Both work in chunks of ``KNOBS.warm_chunk`` bytes and stop as soon as their file is unlinked
(dropped, aborted): at most one chunk is allocated in vain. Allocation never changes a file's
bytes or size, so it is invisible to a writer or reader of the same file.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import libc
from ..knobs import KNOBS
from .rules import charge_file

if TYPE_CHECKING:
    from .index import Catalog
    from .recycle import RecyclePool

__all__ = ["WarmPages", "Warmer", "accept_hint", "fallocate_keep_size", "free_pages_go_to_hypervisor",
           "hinted_pool_size", "machine_headroom", "next_pool_size", "touch_pages", "touching"]


def next_pool_size(catalog: Any, have: dict[int, int], free: int, saving: Collection[str] = (),
                   keep_local: Callable[[str], int] = lambda job: 1, node_id: str | None = None) -> int | None:
    """The pool's sizing rule: the largest shard size that the coming saves of a job held here
    need (its newest step's ranks on this node, shards of at least ``KNOBS.warm_min_bytes``; not
    those whose file that step shares with another, unchanged shards the next save will likely
    link too) beyond the ``have`` pool files of that size, if one more file of it fits in ``free``.

    A job holding ``h`` steps here with ``keep_local`` k needs new files for its next k + 1 - h
    saves (nothing is evicted, so nothing recycled, until it holds k + 1): that many files of
    each size, at least one. The pool never holds more than the job's steady state will.
    A rank held here as a copy (its manifest names another node than ``node_id``) needs new
    files for its next k - h copies only, possibly none: its owner drops the copy of the step
    it evicts before it pushes the next one (see tierckptd.peer.redundancy), so the next copy
    recycles the dropped one's files; its first copy is the owner's hint's (:mod:`tierckptd.peer.hints`).
    Jobs in ``saving`` (a save is open) are skipped: that save took its files already, and its
    commit evicts a step whose files come back to the pool; the commit asks again."""
    want: dict[int, int] = {}
    for job in catalog.jobs():
        if job in saving:
            continue
        steps = catalog.steps(job)
        if not steps:
            continue
        for man in steps[max(steps)].values():
            copy = node_id is not None and man.node != node_id
            saves = max(0, keep_local(job) - len(steps)) if copy else max(1, keep_local(job) + 1 - len(steps))
            if not saves:
                continue
            for s in man.shards:
                if s.size >= max(1, KNOBS.warm_min_bytes) and not catalog.is_shared(man, s):
                    want[s.size] = want.get(s.size, 0) + saves
    return next((size for size in sorted(want, reverse=True)
                 if want[size] > have.get(size, 0) and charge_file(size) <= free), None)


def accept_hint(sizes: list[int], free: int) -> dict[int, int]:
    """The part of a hinted copy's shard sizes (those of at least ``KNOBS.warm_min_bytes``) to warm
    within ``free`` bytes of capacity, largest first: size -> files wanted."""
    want: dict[int, int] = {}
    for size in sorted((s for s in sizes if s >= max(1, KNOBS.warm_min_bytes)), reverse=True):
        if charge_file(size) <= free:
            free -= charge_file(size)
            want[size] = want.get(size, 0) + 1
    return want


def hinted_pool_size(hints: dict[int, int], have: dict[int, int], free: int,
                     made: dict[int, int] | None = None) -> int | None:
    """The next pool file a hint asks for: the largest hinted size of which the pool holds fewer
    files than wanted and fewer were made for the hints than wanted (``made``: size -> files made),
    if it fits in ``free``. Sizes served are dropped from ``hints`` and ``made`` (a hint is served
    once: a copy that takes a hinted file before it is warm does not make the pool warm another)."""
    made = {} if made is None else made
    for size in sorted(hints, reverse=True):
        if have.get(size, 0) >= hints[size] or made.get(size, 0) >= hints[size]:
            del hints[size]
            made.pop(size, None)
        elif charge_file(size) <= free:
            return size
    return None


log = logging.getLogger(__name__)

_FALLOC_FL_KEEP_SIZE = 1


def fallocate_keep_size(fd: int, offset: int, length: int) -> None:
    """Allocate the pages of ``[offset, offset + length)`` without changing the file's size or bytes.

    Raises:
        OSError: ENOSPC, EOPNOTSUPP (the filesystem cannot), ...
    """
    libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length)


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name


def touch_pages(fd: int, offset: int, length: int) -> None:
    """Fault in the pages of ``[offset, offset + length)`` of a file open read-write, as a write
    through a shared map would (``MADV_POPULATE_WRITE``), without changing its bytes or size: a
    page not yet in the file is allocated and zeroed, a page already there (written, or being
    written by another thread under its page lock) is only mapped. Unlike fallocate, the memory
    behind the page is written, so it is really there when the file's writer comes.

    Raises:
        OSError: EINVAL (the kernel is older than 5.14), EFAULT (the filesystem is full: a write
            there would have raised SIGBUS), ENOMEM, ...
    """
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    size = offset + length - start
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start) as m:
        if not libc.available():  # pragma: no cover
            m.madvise(_MADV_POPULATE_WRITE)
            return
        # Through ctypes, which lets go of the GIL for the call: Python's ``mmap.madvise`` holds
        # it, and populating 8 MiB of pages a hypervisor took back takes 10-35 ms here, during
        # which none of the daemon's RPCs could run (bench/README.md, "Session of 2026-12-07, 15:51 UTC").
        view = ctypes.c_char.from_buffer(m)  # its first byte: the map's address
        try:
            libc.madvise(ctypes.addressof(view), size, _MADV_POPULATE_WRITE)
        finally:
            del view  # the map cannot close while a view of it is exported


@functools.cache
def free_pages_go_to_hypervisor(sysfs: str = "/sys/bus/virtio/drivers/virtio_balloon") -> bool:
    """Whether this kernel reports free memory to a hypervisor (a virtio balloon with free page
    reporting, VIRTIO_BALLOON_F_REPORTING, feature bit 5), which takes it back: a page allocated
    again later is backed again by the host on its first write, which here costs 3-4.5 s per GiB
    (bench/README.md, "Fresh pages in a VM"). Pages that fallocate allocates are not written, so
    only touched pages are warm there."""
    try:
        devices = [d for d in Path(sysfs).iterdir() if d.name.startswith("virtio")]
        return any((d / "features").read_text().strip()[5:6] == "1" for d in devices)
    except OSError:
        return False


def _mem_available() -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo, or None where it cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def machine_headroom(fd: int, tmpfs: bool) -> int:
    """Bytes warming may still take from the machine, whatever the store's own capacity says
    (several daemons, or other programs, may share the filesystem): the filesystem's free space
    above ``KNOBS.warm_reserve`` of its size and, on tmpfs (its pages are memory), the memory
    available above that share of all memory."""
    st = os.fstatvfs(fd)
    room = st.f_bavail * st.f_frsize - int(KNOBS.warm_reserve * st.f_blocks * st.f_frsize)
    mem = _mem_available() if tmpfs else None
    if mem is not None:
        room = min(room, mem[0] - int(KNOBS.warm_reserve * mem[1]))
    return max(0, room)


def touching(tmpfs: bool) -> bool:
    """Whether warming touches pages (:func:`touch_pages`) rather than fallocating them, per
    ``KNOBS.warm_touch``. Only on tmpfs: elsewhere touching would write zeros to the disk."""
    mode = KNOBS.warm_touch
    return tmpfs and (mode == 1 or (mode < 0 and free_pages_go_to_hypervisor()))


def _next_hole(fd: int, off: int, end: int) -> int:
    """The first offset at or after ``off`` that holds no data (``end`` if none, or where
    unsupported: ``off``). On tmpfs, pages allocated by fallocate but never written count as holes."""
    try:
        return min(end, os.lseek(fd, off, os.SEEK_HOLE))
    except OSError as e:
        return end if e.errno == errno.ENXIO else off


def _allocated_prefix(fd: int, off: int, end: int) -> int:
    """Where allocation ahead of a writer starts: past the pages the file already has (a warm
    pool file is allocated front to back from 0, a writer writes front to back), whole MiBs.
    SEEK_HOLE cannot tell: on tmpfs a fallocated page that was never written is a hole, so a
    fully warmed file would be walked again, chunk by chunk, each fallocate taking the inode lock
    that the writer's pwrite needs."""
    allocated = os.fstat(fd).st_blocks * 512
    return min(end, max(off, allocated >> 20 << 20))


NextFile = Callable[[], "tuple[int, str, int] | None"]
"""The store's choice of the next pool file to warm: (an open descriptor, its pool name, size), or None."""


class Warmer:
    """The two warming threads of one local store (started on first use).

    Args:
        next_file: called by the background thread (it takes the store's lock): creates the next
            pool file to warm and returns it, or None when the pool has what the jobs need.
        still_pooled: whether a pool name is still an untaken warm file.
        touch: whether to touch pages (:func:`touch_pages`) instead of fallocating them.
        filled: called with a pool name once every page of that file was touched.
        busy: whether the node is busy (a save open or committing, a peer transfer reading):
            the pool thread then waits (between chunks) until :meth:`poke` or a commit's
            :meth:`kick` says it may be idle, so pool warming never competes with a save or a
            transfer.
    """

    def __init__(self, next_file: NextFile, still_pooled: Callable[[str], bool],
                 busy: Callable[[], bool] = lambda: False, touch: Callable[[], bool] = lambda: False,
                 filled: Callable[[str], None] = lambda name: None) -> None:
        self._next_file = next_file
        self._still_pooled = still_pooled
        self._busy = busy
        self._touch = touch
        self._filled = filled
        self.touch_failed = False  # the kernel cannot populate a map: fallocate instead
        self._cv = threading.Condition()
        self._urgent: collections.deque[tuple[int, int, int]] = collections.deque()  # fd, offset, end
        self._kicked = False
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self.disabled = False  # the filesystem cannot fallocate
        self._active = 0  # threads between taking work and finishing it (see :meth:`idle`)
        self._held = 0  # of those, threads waiting for the node to become idle (see :meth:`_wait_idle`)
        self.prefaulted = 0  # bytes allocated ahead of a writer
        self.warmed = 0  # bytes allocated in pool files

    # -- requests

    def kick(self) -> None:
        """Something was committed: top the pool up (background)."""
        with self._cv:
            if self._stopped or self.disabled:
                return
            self._start_locked()
            self._kicked = True
            self._cv.notify_all()

    def poke(self) -> None:
        """The node may have become idle (a save or transfer ended): re-check a waiting pool thread."""
        with self._cv:
            self._cv.notify_all()

    def prefault(self, fd: int, size: int, offset: int = 0) -> None:
        """Allocate ``fd``'s pages from ``offset`` ahead of a writer; the warmer owns (closes) ``fd``."""
        with self._cv:
            if self._stopped or self.disabled or offset >= size:
                os.close(fd)
                return
            self._start_locked()
            self._urgent.append((fd, offset, size))
            self._cv.notify_all()

    def idle(self) -> bool:
        """Nothing to do until something happens: no kick or prefault pending, and no thread
        working except one held while the node is busy (for tests; a commit, the end of a save or
        a prefault after this answer starts work again)."""
        with self._cv:
            if self._kicked or self._urgent:
                return False
            return not self._active or (self._active == self._held and self._busy())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both threads (each finishes its current chunk) and close every queued descriptor."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            threads, self._threads = self._threads, []
        for t in threads:
            t.join(timeout)
        with self._cv:
            while self._urgent:
                os.close(self._urgent.popleft()[0])

    def _start_locked(self) -> None:
        if self._threads:
            return
        for name, target in (("tck-warm-urgent", self._urgent_loop), ("tck-warm-pool", self._pool_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    # -- the threads

    def _urgent_loop(self) -> None:
        while True:
            with self._cv:
                while not self._urgent and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                fd, off, end = self._urgent.popleft()
                self._active += 1
            try:
                self.prefaulted += self._fill(fd, off, end, None)[1]
            finally:
                os.close(fd)
                with self._cv:
                    self._active -= 1

    def _pool_loop(self) -> None:
        try:  # this thread only (Linux: a thread id is a process id for setpriority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):  # pragma: no cover
            pass
        while True:
            with self._cv:
                while not self._kicked and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                self._kicked = False
                self._active += 1
            try:
                self._pool_pass()
            finally:
                with self._cv:
                    self._active -= 1

    def _pool_pass(self) -> None:
        """Warm pool files until there is none to warm (or on stop, or an error)."""
        while not self._stopped and not self.disabled:
            try:
                got = self._next_file()
            except Exception:  # thread boundary: warming is an optimisation, never fatal
                log.exception("warming the recycle pool failed")
                return
            if got is None:
                return
            fd, name, size = got
            try:
                touched = self._touching()
                reached, allocated, failed = self._fill(fd, 0, size, name)
                self.warmed += allocated
                if failed:
                    return
                if touched and reached >= size and not self.touch_failed:
                    self._filled(name)
            finally:
                os.close(fd)

    def _wait_idle(self, pooled: str) -> bool:
        """Wait while the node is busy (woken by :meth:`poke` and :meth:`kick`, re-checked every
        ``KNOBS.warm_idle_poll`` seconds in case a wake-up was missed); False once the pool file
        was taken or on stop."""
        while self._busy() and not self._stopped and self._still_pooled(pooled):
            with self._cv:
                self._held += 1
                try:
                    self._cv.wait(KNOBS.warm_idle_poll)
                finally:
                    self._held -= 1
        return self._still_pooled(pooled) and not self._stopped

    def _touching(self) -> bool:
        return not self.touch_failed and self._touch()

    def _allocate(self, fd: int, off: int, n: int, touch: bool) -> None:
        """Allocate one chunk: touched, or fallocated (also where touching turns out unsupported)."""
        if touch and self._touching():
            try:
                touch_pages(fd, off, n)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("warming fallocates pages: this kernel cannot populate a map (%s)", e.strerror)
                self.touch_failed = True
        fallocate_keep_size(fd, off, n)

    def _fill(self, fd: int, off: int, end: int, pooled: str | None) -> tuple[int, int, bool]:
        """Allocate ``[off, end)`` chunk by chunk; stop early when the file is unlinked, when
        ``pooled`` (a pool name) was taken, or on stop. Returns the offset reached, the bytes
        allocated here (ranges a writer had already reached are skipped, not counted) and
        whether an error stopped it (the filesystem is full or cannot allocate)."""
        allocated = 0
        try:
            if pooled is None:
                off = _allocated_prefix(fd, off, end)
            while off < end and not self._stopped:
                if pooled is not None and not self._wait_idle(pooled):
                    break
                if not os.fstat(fd).st_nlink:  # dropped or aborted
                    break
                if pooled is None:  # never behind the writer: skip to the next hole
                    off = _next_hole(fd, off, end)
                    if off >= end:
                        break
                n = min(max(1 << 20, KNOBS.warm_chunk), end - off)
                self._allocate(fd, off, n, pooled is not None)
                off += n
                allocated += n
        except OSError as e:
            if e.errno == errno.EFAULT:  # touching a full filesystem (a write there would SIGBUS)
                return off, allocated, True
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                log.info("warming disabled: the local dir cannot fallocate (%s)", e.strerror)
                self.disabled = True
            elif e.errno != errno.ENOSPC:
                log.warning("warming stopped: %s", e)
            return off, allocated, True
        return off, allocated, False


class WarmPages:
    """The local store's warm pages: whether to warm, the peers' hints, and the pool's next file.

    Args:
        lock: the store's lock (guards ``catalog``, ``recycle`` and the hints).
        free_locked: the store's free capacity in bytes (called with ``lock`` held).
        saves_busy: whether a save is open or committing here; with the peer transfers marked by
            :meth:`sending`, what makes the node busy (see :class:`Warmer`).
        saving_locked: the jobs with a save open (called with ``lock`` held; see :func:`next_pool_size`).
        keep_local: a job's ``keep_local`` (see :func:`next_pool_size`).
        headroom: called with :attr:`tmpfs`: what the machine can still give (see
            :func:`machine_headroom`); warming stays within it as well as within free capacity.
    """

    def __init__(self, lock: threading.RLock, catalog: Catalog, recycle: RecyclePool,
                 free_locked: Callable[[], int], saves_busy: Callable[[], bool],
                 saving_locked: Callable[[], Collection[str]] = frozenset,
                 keep_local: Callable[[str], int] = lambda job: 1,
                 headroom: Callable[[bool], int] | None = None) -> None:
        self._lock = lock
        self._catalog = catalog
        self._recycle = recycle
        self._free_locked = free_locked
        self._saving_locked = saving_locked
        self._keep_local = keep_local
        self._headroom = headroom
        self.tmpfs = False  # the local dir is on tmpfs (set when the store opens)
        self._saves_busy = saves_busy
        self._sending = 0  # peer transfers reading from the store (see :meth:`sending`)
        self.warmer = Warmer(self._next_warm, recycle.is_warm, self._busy, lambda: touching(self.tmpfs),
                             self._filled)
        self._hints: dict[int, int] = {}  # hinted pool files still to warm: size -> files wanted
        self._hints_made: dict[int, int] = {}  # of those, size -> pool files made for them so far
        self.hints_off = False  # the store holds a reserve (see .reserve): a first copy takes that instead
        self.on_idle: Callable[[], None] = lambda: None  # the store's other background work to wake (the reserve)
        self.node_id: str | None = None  # this node (set by the store): ranks of other owners are copies

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """A peer transfer reads from the store while the block runs: the pool thread waits (and the
        reserve's refill, see :meth:`busy`)."""
        with self._lock:
            self._sending += 1
        try:
            yield
        finally:
            with self._lock:
                self._sending -= 1
            self.warmer.poke()
            self.on_idle()

    def busy(self) -> bool:
        """A save open or committing, or a peer transfer reading (see :meth:`sending`): what
        background page work (pool warming, the reserve's refill) waits for."""
        return self._busy()

    def _room_locked(self) -> int:
        """What warming may take: the store's free capacity, within the machine's headroom."""
        free = self._free_locked()
        if self._headroom is not None:
            try:
                free = min(free, self._headroom(self.tmpfs))
            except OSError as e:
                log.warning("warming paused: the local dir's free space is unknown (%s)", e)
                return 0
        return free

    def _filled(self, name: str) -> None:
        """Every page of pool file ``name`` was touched: a save that takes it is told it is
        faulted in, like a recycled file (see :meth:`.recycle.RecyclePool.take`)."""
        with self._lock:
            self._recycle.mark_touched(name)

    def _busy(self) -> bool:
        """A save open or committing, or a peer transfer reading (a snapshot, without the lock)."""
        return self._sending > 0 or self._saves_busy()

    def warming(self, mode: int) -> bool:
        return bool(mode) and (mode >= 2 or self.tmpfs) and not self.warmer.disabled

    def prefaulter(self, prefault: bool) -> Callable[[int, int], None] | None:
        """What allocates a save's new staging files ahead of the writer (``prefault``: an
        inbound replica or a restore), or None when that is off here."""
        return self.warmer.prefault if prefault and self.warming(KNOBS.warm_ahead) else None

    def committed(self) -> None:
        """A save was committed: top the pool up in the background (when pool warming is on)."""
        if self.warming(KNOBS.warm_pool):
            self.warmer.kick()

    def counters(self) -> dict[str, int]:
        """Warm files taken by saves; bytes allocated in pool files and ahead of writers."""
        with self._lock:
            taken = self._recycle.warm_taken
        return {"warm_taken": taken, "warmed_bytes": self.warmer.warmed, "prefaulted_bytes": self.warmer.prefaulted}

    def expect(self, job: str, rank: int, sizes: list[int]) -> int:
        """A peer's first copy of its (job, rank) with these shard sizes is coming (a WarmReplica
        hint, see :mod:`tierckptd.peer.hints`): warm pool files for it in free capacity, in the
        background. Ignored when hints are off here, when the store holds a reserve (the copy
        takes it), or when this node holds a step of that rank (the copy will recycle its files).
        Returns the bytes accepted."""
        with self._lock:
            if self.hints_off or not self.warming(KNOBS.warm_hint):
                return 0
            if any(rank in ranks for ranks in self._catalog.steps(job).values()):
                return 0
            pending = sum(charge_file(size) * (n - self._hints_made.get(size, 0)) for size, n in self._hints.items())
            want = accept_hint(sizes, self._room_locked() - pending)
            for size, n in want.items():
                self._hints[size] = self._hints.get(size, 0) + n
        if want:
            self.warmer.kick()
        return sum(size * n for size, n in want.items())

    def _next_warm(self) -> tuple[int, str, int] | None:
        """The warming thread's next pool file: one a peer's hint asks for, else
        the largest shard size that the next save of a job held here needs (its newest step's
        ranks on this node) beyond what the pool holds; only if it fits in free capacity; created
        in the pool. None when there is none (pending hints are then dropped)."""
        with self._lock:
            free, have = self._room_locked(), self._recycle.counts()
            size = hinted_pool_size(self._hints, have, free, self._hints_made) if self._hints else None
            hinted = size is not None
            if not hinted:
                self._hints.clear()
                self._hints_made.clear()
                if self.warming(KNOBS.warm_pool):
                    size = next_pool_size(self._catalog, have, free, self._saving_locked(), self._keep_local,
                                          self.node_id)
            if size is None:
                return None
            fd, name = self._recycle.add_warm(size)
            if hinted:
                self._hints_made[size] = self._hints_made.get(size, 0) + 1
            return fd, name, size
