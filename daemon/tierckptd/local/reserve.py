"""The reserve: pre-touched memory held from start-up (``local_reserve``), handed to new files.

Before its first eviction a job writes every save into new memory; on a VM whose kernel hands
free memory back to the host, a page written for the first time costs 3-4.5 s per GiB, and on
any machine a fault and zeroing. Back-to-back saves leave the idle-time warming of :mod:`.warm`
no time. The reserve holds ``local_reserve`` bytes (sized like a RAM disk for a job:
(keep_local + 1) x the node's checkpoint) in files under ``reserve/``, every page touched
(written) at start-up on tmpfs, allocated elsewhere. A save or an inbound replica takes it
before any new memory (:meth:`Reserve.take_locked`), for each shard the recycle pool could not
cover, largest first:

- *whole*: the smallest reserve file of at least the shard's size, if at most twice as large, is
  renamed into the staging area and truncated to the shard's size (its pages stay with the file;
  the tail goes back to the kernel); where no file is that large, the largest one is, extended
  to the shard's size, and the rest is freed for it as below;
- *freed*: otherwise the shard's bytes are covered by reserve files unlinked just before the
  staging file is created. Their pages go back to the kernel's free lists, where the writer's
  faults find them again (a page the kernel has not yet reported to a hypervisor is still backed
  by the host; free page reporting waits seconds and puts reported pages at the tail).

Shards of any size are covered, whole files where the sizes allow. A file taken whole counts as
faulted in (the client writes it like a recycled file).

Accounting: every reserve file is charged like any file (:func:`.rules.charge_file`) and counts as
used capacity; a save that takes reserve memory releases that charge before it makes room, so the
reserve is capacity set aside, never a reason a save fails. Status and /metrics show it.

Refill, off the save path: a step's files evicted by retention join the reserve while it is short
(a rename: their pages are already there; not while a save makes room, whose plan counts on
freeing them), so in the steady state the reserve holds files of the job's own shard sizes; and a
background thread touches new files of ``KNOBS.reserve_extent`` bytes into free capacity while the
node is idle. At start-up, files left in ``reserve/`` by a previous run (regular, one link,
``<size>.<id>`` of that size) are kept up to the target and touched again; anything else there is
removed (a symlink as a link).

With a reserve, the store neither warms pool files after commits nor takes peers' WarmReplica
hints (:mod:`.warm`): the reserve holds the pages they would add.

Every file operation goes through :class:`.localfs.LocalDir` (no symlink is followed). The
in-memory state is guarded by the store's lock (methods ending in ``_locked``); file moves of
taken files happen outside it, on files no one else can take.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..knobs import KNOBS
from .localfs import STAGING_MODE, LocalDir, UnsafeFileError
from .rules import charge_file
from .warm import fallocate_keep_size, touch_pages

__all__ = ["Reserve", "Grant", "RESERVE_DIR"]

log = logging.getLogger(__name__)

RESERVE_DIR = ("reserve",)
_NAME = re.compile(r"([0-9]{1,19})\.[0-9a-f]{12}")


@dataclass
class Grant:
    """What one save took from the reserve: ``whole`` (shard -> reserve file name and its size)
    and ``freed`` (files to unlink for the writer), ``covered``: shard bytes accounted for."""

    whole: dict[str, tuple[str, int]] = field(default_factory=dict)
    freed: list[tuple[str, int]] = field(default_factory=list)
    covered: int = 0

    def __bool__(self) -> bool:
        return bool(self.whole or self.freed)


class Reserve:
    """The reserve's files and its filling thread (see the module docstring).

    Args:
        fs: the local dir (the reserve lives in ``reserve/``).
        lock: the store's lock.
        target: ``local_reserve`` bytes (0: no reserve).
        room_locked: free capacity in bytes (called with ``lock`` held).
        busy: whether a save is open or committing, or a peer transfer reads from the store
            (refills after start-up wait while it is; :meth:`poke` when that may have ended).
    """

    def __init__(self, fs: LocalDir, lock: threading.RLock, target: int, room_locked: Callable[[], int],
                 busy: Callable[[], bool] = lambda: False) -> None:
        self.fs, self._lock, self.target = fs, lock, target
        self._room_locked, self._busy = room_locked, busy
        self._ready: list[tuple[int, str]] = []  # (size, name), sorted: files ready to hand out
        self._pending: list[tuple[int, str]] = []  # kept at start-up, to touch again before use
        self._filling: set[str] = set()  # files the thread is touching (charged already)
        self.bytes = 0  # charged bytes of every reserve file (ready, pending or filling)
        self.data_bytes = 0
        self.ready_bytes = 0
        self.taken_bytes = 0  # shard bytes covered by the reserve (a counter)
        self.adopted_bytes = 0  # bytes refilled from evicted files (a counter)
        self.touched_bytes = 0  # bytes touched or allocated by the thread (a counter)
        self.tmpfs = False
        self.adopting = True  # evicted files may join (paused while a save makes room)
        self._cv = threading.Condition()
        self._kicked = False
        self._active = False  # the thread is between taking a kick and finishing its pass
        self._stopped = False
        self._started_up = False
        self._thread: threading.Thread | None = None

    # -- the files, under the store's lock

    def _add_locked(self, size: int, name: str) -> None:
        bisect.insort(self._ready, (size, name))
        self.ready_bytes += size

    def _pop_locked(self, i: int) -> tuple[int, str]:
        size, name = self._ready.pop(i)
        self.ready_bytes -= size
        self.bytes -= charge_file(size)
        self.data_bytes -= size
        return size, name

    def take_locked(self, files: Iterable[tuple[str, int]]) -> Grant:
        """Take reserve memory for new staging files ``files`` ((shard, size)); see the module docstring."""
        g = Grant()
        budget = 0
        for shard, size in sorted(files, key=lambda x: -x[1]):
            if not self._ready or size <= 0:
                break
            i = bisect.bisect_left(self._ready, (size, ""))
            if i < len(self._ready) and self._ready[i][0] <= 2 * size:
                fsize, name = self._pop_locked(i)
                g.whole[shard] = (name, fsize)
                g.covered += size
            elif i == len(self._ready):  # none large enough: the largest, extended
                fsize, name = self._pop_locked(i - 1)
                g.whole[shard] = (name, fsize)
                g.covered += fsize
                budget += size - fsize
            else:
                budget += size
        while budget > 0 and self._ready:
            i = bisect.bisect_right(self._ready, (budget, "~")) - 1  # the largest file within the budget
            fsize, name = self._pop_locked(max(i, 0))
            g.freed.append((name, fsize))
            g.covered += min(fsize, budget)
            budget -= fsize
        self.taken_bytes += g.covered
        return g

    def untake_locked(self, g: Grant) -> None:
        """Give back what :meth:`take_locked` handed out (the save did not begin)."""
        for name, size in [*g.whole.values(), *g.freed]:
            self._add_locked(size, name)
            self.bytes += charge_file(size)
            self.data_bytes += size
        self.taken_bytes -= g.covered

    def adopt_locked(self, dir_fd: int, name: str, size: int) -> bool:
        """An evicted file (entry ``name`` of ``dir_fd``, one link, nobody reading it): move it into
        the reserve if the reserve is short of that much. Returns whether it was moved."""
        if not self.adopting or size <= 0 or self.data_bytes + size > self.target:
            return False
        target = f"{size}.{secrets.token_hex(6)}"
        try:
            with self.fs.dir(RESERVE_DIR) as rfd:
                os.rename(name, target, src_dir_fd=dir_fd, dst_dir_fd=rfd)
        except OSError:
            return False
        self._add_locked(size, target)
        self.bytes += charge_file(size)
        self.data_bytes += size
        self.adopted_bytes += size
        return True

    # -- handing taken files over (outside the lock)

    def free(self, g: Grant) -> None:
        """Unlink the files ``g`` frees (their pages go to the kernel for the writer to fault in)."""
        if g.freed:
            with self.fs.dir(RESERVE_DIR) as rfd:
                for name, _size in g.freed:
                    self.fs.unlink(rfd, name)
            g.freed = []

    def hand_over(self, g: Grant, shard: str, dst_fd: int, size: int) -> bool:
        """Move the reserve file ``g`` took for ``shard`` to entry ``shard`` of ``dst_fd``, sized
        ``size``. False (the file is discarded) if it is no longer a regular file of its size with
        one link, or was swapped meanwhile."""
        name, fsize = g.whole.pop(shard)
        with self.fs.dir(RESERVE_DIR) as rfd:
            try:
                fd = self.fs.open_regular(rfd, name, os.O_RDWR, f"reserve file {name}", size=fsize, single_link=True)
            except FileNotFoundError:
                return False
            except UnsafeFileError as e:
                log.error("discarding reserve file: %s", e)
                self.fs.remove_tree(rfd, name)
                return False
            try:
                os.fchmod(fd, STAGING_MODE)
                os.rename(name, shard, src_dir_fd=rfd, dst_dir_fd=dst_fd)
                os.ftruncate(fd, size)
                st = os.fstat(fd)
            finally:
                os.close(fd)
        if not self.fs.same_file(dst_fd, shard, st):
            log.error("discarding reserve file %s: replaced while being handed over", name)
            self.fs.remove_tree(dst_fd, shard)
            return False
        return True

    def discard(self, g: Grant) -> None:
        """Remove the files ``g`` took and did not hand over (the save failed to begin)."""
        with self.fs.dir(RESERVE_DIR) as rfd:
            for name, _size in [*g.whole.values(), *g.freed]:
                self.fs.remove_tree(rfd, name)
        g.whole, g.freed = {}, []

    # -- start-up and the filling thread

    def open(self, tmpfs: bool) -> None:
        """Start-up (before serving): keep the previous run's reserve files up to the target (to be
        touched again), remove anything else in ``reserve/``, and start filling."""
        self.tmpfs = tmpfs
        kept = 0
        with self.fs.dir(RESERVE_DIR, create=True) as rfd:
            for name, kind in sorted(self.fs.entries(rfd)):
                m = _NAME.fullmatch(name)
                size = int(m.group(1)) if m else 0
                if kind == "file" and 0 < size and kept + size <= self.target and self._intact(rfd, name, size):
                    self._pending.append((size, name))
                    self.bytes += charge_file(size)
                    self.data_bytes += size
                    kept += size
                else:
                    self.fs.remove_tree(rfd, name)
        if kept:
            log.info("reserve: %d bytes in %d files kept from the previous run", kept, len(self._pending))
        if self.target:
            self.kick()

    def _intact(self, rfd: int, name: str, size: int) -> bool:
        try:
            os.close(self.fs.open_regular(rfd, name, os.O_RDONLY, f"reserve file {name}", size=size,
                                          single_link=True))
            return True
        except (OSError, UnsafeFileError):
            return False

    def kick(self) -> None:
        """Top the reserve up in the background (after a commit: waits while the node is busy)."""
        if not self.target:
            return
        with self._cv:
            if self._stopped:
                return
            self._kicked = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tck-reserve", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def poke(self) -> None:
        """The node may have become idle (a save or transfer ended): re-check a waiting refill."""
        with self._cv:
            self._cv.notify_all()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout)

    def idle(self) -> bool:
        """Whether the thread has nothing to do until the next kick (for tests and the bench)."""
        with self._cv:
            return not self._kicked and not self._active

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._kicked and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                self._kicked = False
                self._active = True
            try:
                self._pass()
            except Exception:  # thread boundary: the reserve is an optimisation, never fatal
                log.exception("filling the reserve failed")
            finally:
                with self._cv:
                    self._active = False
            self._started_up = True

    def _next_locked(self) -> tuple[int, str] | None:
        """The next file to touch: one kept at start-up, else a new one within the deficit and
        free capacity (created and charged here)."""
        if self._pending:
            size, name = self._pending.pop()
            self._filling.add(name)
            return size, name
        short = self.target - self.data_bytes
        size = min(max(1 << 20, KNOBS.reserve_extent), short)
        if size < min(1 << 20, self.target) or charge_file(size) > self._room_locked():
            return None
        name = f"{size}.{secrets.token_hex(6)}"
        with self.fs.dir(RESERVE_DIR, create=True) as rfd:
            os.close(self.fs.create(rfd, name, size))
        self._filling.add(name)
        self.bytes += charge_file(size)
        self.data_bytes += size
        return size, name

    def _pass(self) -> None:
        while not self._stopped:
            with self._lock:
                got = self._next_locked()
            if got is None:
                return
            size, name = got
            ok = False
            try:
                ok = self._fill(name, size)
            finally:
                with self._lock:
                    self._filling.discard(name)
                    if ok:
                        self._add_locked(size, name)
                    else:
                        self.bytes -= charge_file(size)
                        self.data_bytes -= size
                        with self.fs.dir(RESERVE_DIR) as rfd:
                            self.fs.remove_tree(rfd, name)
            if not ok:
                return

    def _fill(self, name: str, size: int) -> bool:
        """Touch (tmpfs) or allocate every page of reserve file ``name``, chunk by chunk; after
        start-up, only while the node is idle. False on stop or error."""
        with self.fs.dir(RESERVE_DIR) as rfd:
            fd = self.fs.open_regular(rfd, name, os.O_RDWR, f"reserve file {name}", size=size, single_link=True)
        try:
            off = 0
            while off < size:
                while self._started_up and self._busy() and not self._stopped:
                    with self._cv:
                        self._cv.wait(KNOBS.warm_idle_poll)
                if self._stopped:
                    return False
                n = min(max(1 << 20, KNOBS.warm_chunk), size - off)
                if self.tmpfs:
                    touch_pages(fd, off, n)
                else:
                    fallocate_keep_size(fd, off, n)
                off += n
                self.touched_bytes += n
            return True
        except OSError as e:
            if e.errno == errno.EINVAL and self.tmpfs:
                log.info("reserve: this kernel cannot populate a map; allocating instead")
                self.tmpfs = False
                return self._fill(name, size)
            log.warning("reserve: filling stopped (%s)", e.strerror or e)
            return False
        finally:
            os.close(fd)
