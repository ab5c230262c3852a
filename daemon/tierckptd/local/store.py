"""The local tier: staging files, committed ranks, retention, capacity and the catalog.

Layout under ``local_dir``::

    .fs-token                                   random token: proves a client shares this filesystem
    staging/<save_id>/<shard>                   bytes being written (never read by restore)
    recycle/<size>.<id>                         data files of evicted steps kept for reuse
    reserve/<size>.<id>                         pre-touched memory held for new files (local_reserve)
    jobs/<job>/<step:020d>/rank-<rank:07d>/<shard>.<generation>    committed data
    jobs/<job>/<step:020d>/rank-<rank:07d>/manifest.json           the commit marker, written last

Commit protocol: staging files are renamed into the rank directory, flushed when the medium is
durable, then ``manifest.json`` is written under a temporary name and renamed over any older
manifest (a re-save of the same step replaces it atomically; the old data files are removed
after the rename). At start-up the catalog is rebuilt from the manifests; staging leftovers and
rank directories without a manifest are reclaimed; ranks whose manifest fails a rule are moved
to ``quarantine/`` (never deleted), see :mod:`.startup`.

The local dir is writable by trainers in the socket group, so every file operation goes through
:class:`.localfs.LocalDir`: no symlink below the root is ever followed, commit accepts only
regular files of exactly the declared size, and the daemon reads committed shards through
:meth:`LocalStore.open_shard`. Files are created 0640 and directories 0750.

Resource bounds: every file is charged at least ``rules.MIN_CHARGE`` bytes and every manifest its
stored size (metadata included) and at least that; capacity is decided before anything is
evicted; at most ``max_open_saves`` saves are open, each of at most ``max_shards_per_save``
shards, each rank's metadata at most ``max_metadata_bytes``.

Pieces: :mod:`.index` (in-memory state, the catalog), :mod:`.rules` (which steps go),
:mod:`.recycle` (reuse of evicted files), :mod:`.staging` (open saves and spec rules),
:mod:`.localfs` (symlink-safe file operations), :mod:`.paths` (the file steps), :mod:`.startup`
(lock, recovery, quarantine), :mod:`.eviction` (carrying out retention and capacity evictions),
:mod:`.saves` (open saves), :mod:`.commit` (the commit path), :mod:`.links` (unchanged shards
shared by inode), :mod:`.warm` (warm pages), :mod:`.reserve` (memory held from start-up).
:class:`LocalStore` is their facade.

Thread safety: every public method may be called from any thread (the daemon calls them through
:func:`tierckptd.offload.run_blocking`). One lock guards the in-memory state; long file I/O
happens outside it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierckpt.common.names import MAX_METADATA_BYTES, MAX_SHARDS_PER_RANK

from ..knobs import KNOBS
from .commit import Committer
from .eviction import Evictor
from .index import Catalog, CompletenessFn
from .links import share_fn
from .localfs import LocalDir, fs_is_tmpfs
from .manifest import Manifest
from .paths import StoreLayout
from .policies import JobPolicies, JobPolicy
from .queries import StoreQueries
from .recycle import RecyclePool
from .reserve import Reserve
from .retain import StoreRetention
from .rules import Eviction, charge_file
from .saves import OpenSaves
from .staging import ShardSpec, StagedFile, Staging
from .startup import default_capacity, fit_reserve, prepare_local_dir, rebuild, write_fs_token
from .warm import WarmPages, free_pages_go_to_hypervisor, machine_headroom, touching

__all__ = ["LocalStore", "Staging", "StagedFile", "Usage", "Eviction", "fs_is_tmpfs", "DEFAULT_MAX_OPEN_SAVES"]

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN_SAVES = 1024


@dataclass(frozen=True)
class Usage:
    """Shard bytes held (committed, being saved, in the recycle pool), and ``charged``: what
    counts against the capacity (every file at least ``rules.MIN_CHARGE``, every manifest its
    size with its metadata and at least that), of which ``staging_charged`` by open and committing
    saves and ``recycle_charged`` by the recycle pool. Status and /metrics report the charged
    figures."""

    capacity: int
    committed: int
    staging: int
    recycle: int
    charged: int = 0
    warm: int = 0  # the part of ``recycle`` allocated ahead of need (see :mod:`.warm`)
    staging_charged: int = 0
    recycle_charged: int = 0
    reserve: int = 0  # bytes held by the reserve (see :mod:`.reserve`), charged as ``reserve_charged``
    reserve_charged: int = 0
    reserve_target: int = 0
    reserve_ready: int = 0  # of ``reserve``, touched and ready to hand out
    reserve_taken: int = 0  # shard bytes the reserve covered since start-up (a counter)

    @property
    def used(self) -> int:
        return self.committed + self.staging + self.recycle + self.reserve

    @property
    def free(self) -> int:
        return max(0, self.capacity - max(self.charged, self.used))


class LocalStore(StoreRetention, StoreQueries):
    """The node's local tier. See the module docstring for layout, protocol and bounds.

    Args:
        root: the local directory.
        node_id: this node's id (owner recorded in manifests of ranks saved here).
        capacity: bytes the tier may hold; 0 means 90% of the filesystem size.
        keep_local: newest complete steps per job kept (>= 1).
        fsync: "auto", "always" or "never".
        max_shard_bytes: largest shard accepted.
        is_complete: completeness rule used by retention (default: every rank held here);
            the peer tier's membership supplies a cluster-aware one.
        on_evict: called (from the evicting thread) with every eviction.
        max_open_saves: saves begun and not yet committed or aborted, in total; one more is
            refused with CapacityError (RESOURCE_EXHAUSTED).
        max_shards_per_save: shards one save may declare (InvalidArgumentError naming ``shards``).
        max_metadata_bytes: metadata one rank's commit may carry (InvalidArgumentError naming
            ``metadata``); the manifest it is stored in is charged against the capacity.
        reserve: bytes of pre-touched memory held for new staging files (``local_reserve``, see
            :mod:`.reserve`); counted as used.
    """

    def __init__(self, root: str | os.PathLike, node_id: str, *, capacity: int = 0, keep_local: int = 2,
                 fsync: str = "auto", max_shard_bytes: int = 1 << 40, is_complete: CompletenessFn | None = None,
                 on_evict: Callable[[Eviction], None] | None = None,
                 max_open_saves: int = DEFAULT_MAX_OPEN_SAVES, policies: JobPolicies | None = None,
                 max_shards_per_save: int = MAX_SHARDS_PER_RANK, max_metadata_bytes: int = MAX_METADATA_BYTES,
                 reserve: int = 0) -> None:
        self.root = Path(root).absolute()
        self.node_id = node_id
        self._capacity_arg = capacity
        self.capacity = capacity
        self.keep_local = keep_local
        self.policies = policies or JobPolicies(JobPolicy(keep_local, 0, 0))  # per-job overrides
        self._fsync_mode = fsync
        self.fsync = fsync == "always"
        self.max_shard_bytes = max_shard_bytes
        self.max_open_saves = max_open_saves
        self.fs_token = ""
        self._lock = threading.RLock()
        self._fs = LocalDir(self.root)
        self._catalog = Catalog(is_complete)
        self._recycle = RecyclePool(self._fs, charge_file)
        # The refill waits for saves and for peer transfers reading from here (a step's replication
        # right after its commit, which kicks the refill): self.warm knows both (made below).
        self.reserve = Reserve(self._fs, self._lock, reserve, lambda: self.capacity - self._used_locked(),
                               lambda: self.warm.busy())  # noqa: PLW0108 (made below)
        self._recycle.sink = self.reserve.adopt_locked if reserve else None
        self._layout = StoreLayout(self._fs, self._recycle, self.reserve if reserve else None)
        self.counters: dict[str, int] = {"staging_reclaimed": 0, "evictions_capacity_undrained": 0,
                                         "quarantined": 0}
        self._evictor = Evictor(self._catalog, self._layout, self._recycle, self.counters)
        self.safe_elsewhere: Callable[[Manifest], bool] = lambda man: False
        """Whether a committed rank is safe in another tier (a live peer, the persistent store):
        set by the node from its tiers; called under the lock, so it must be cheap."""
        self.external_charge: Callable[[], int] = lambda: 0
        """Bytes held in the local dir outside the store and charged against its capacity (the
        parity held for peers: :mod:`tierckptd.parity`); called under the lock, so it must be cheap
        and take no lock of the store's."""
        self._saves = OpenSaves(self._lock, self._fs, self._layout, self._recycle, self._make_room_locked,
                                max_open_saves=max_open_saves, max_shard_bytes=max_shard_bytes,
                                counters=self.counters, catalog=self._catalog, max_shards=max_shards_per_save)
        self._lock_fd: int | None = None
        self._on_evict = on_evict
        # Warm pages (see tierckptd.local.warm): counters(), expect() for peer hints, sending() for transfers.
        self.warm = WarmPages(self._lock, self._catalog, self._recycle, lambda: self.capacity - self._used_locked(),
                              self._saves.busy, self._saves.open_jobs_locked, self.policies.keep_local,
                              lambda tmpfs: machine_headroom(self._fs.fd, tmpfs))
        self.warm.hints_off = bool(reserve)  # the reserve holds what hinted pool files would add
        self.warm.on_idle = self.reserve.poke
        self.warm.node_id = self.node_id
        self._committer = Committer(self._lock, self._saves, self._layout, self._catalog, self._recycle,
                                    self._retain_locked, max_metadata_bytes)

    # ----------------------------------------------------------------------------- start-up

    def open(self) -> None:
        """Create the layout, reclaim leftovers and rebuild the catalog from the manifests.

        Raises:
            ConfigError: another live daemon holds this local_dir (its start-up would have
                reclaimed that daemon's staging files), or the local dir, its ``.lock`` or its
                ``jobs`` directory is a symlink.
        """
        self._lock_fd = prepare_local_dir(self._fs, self.counters)  # held (with the lock) until the process exits
        self.warm.tmpfs = fs_is_tmpfs(self.root)
        if touching(self.warm.tmpfs):
            log.info("warm pages are touched, not only allocated (warm_touch=%d; free memory goes back to a "
                     "hypervisor here: %s)", KNOBS.warm_touch, free_pages_go_to_hypervisor())
        if self._fsync_mode == "auto":
            self.fsync = not self.warm.tmpfs
        self.capacity = self._capacity_arg or default_capacity(self._fs)
        self.reserve.target = fit_reserve(self.reserve.target, self.capacity, bool(self._capacity_arg), self.root)
        self.fs_token = write_fs_token(self._fs)
        res = rebuild(self._fs, self._catalog, self._recycle, self.policies, StoreLayout.rank_rel, self.counters)
        log.info("catalog rebuilt: %d committed ranks, %d uncommitted leftovers removed, %d quarantined",
                 len(res.manifests), res.dropped, res.quarantined)
        self.reserve.open(self.warm.tmpfs)  # filled in the background, touched on tmpfs

    def close(self) -> None:
        """Stop warming; release the local_dir lock (a process exit releases it too)."""
        self.warm.warmer.stop()
        self.reserve.stop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._fs.close()

    # ----------------------------------------------------------------------------- paths

    def _rank_dir(self, job: str, step: int, rank: int) -> Path:
        return self._layout.rank_path(job, step, rank)

    def shard_path(self, man: Manifest, shard: str) -> Path:
        """Where a committed shard lives, for logs and for a client on this node to map. The
        daemon itself opens shards with :meth:`open_shard`, never by this path."""
        return self._layout.shard_path(man, shard)

    def open_shard(self, man: Manifest, shard: str) -> int:
        """A read-only descriptor of a committed shard (O_NOFOLLOW; a regular file of its size).

        The caller closes it. ReadShard, the peer bulk sender and uploads should read through it.

        Raises:
            KeyError: ``shard`` is not part of ``man``.
            NotFoundError: the file is gone (evicted or re-saved since ``man`` was read).
            DataLossError: the file is not a regular file of the recorded size (it was tampered with).
        """
        return self._layout.open_shard(man, shard)

    # ----------------------------------------------------------------------------- saving

    def begin(self, job: str, step: int, rank: int, world_size: int, specs: Sequence[ShardSpec], *,
              stream: bool = False, prefault: bool = False, evictable: Callable[[str], bool] | None = None,
              unchanged: Collection[str] = (), base_step: int | None = None,
              checksums: Mapping[str, str] | None = None, base_generation: str | None = None,
              job_owner: str = "") -> Staging:
        """Reserve capacity and create sized staging files for one rank's shards.

        Args:
            specs: (name, size, dtype, shape) per shard.
            stream: bytes will arrive through :meth:`write_chunk` rather than from the client directly.
            prefault: allocate the pages of the files the recycle pool could not cover in the
                background, ahead of the writer (an inbound replica or a restore, see :mod:`.warm`).
            evictable: the jobs whose steps may be evicted to make room (None: any): a TCP client
                restricted by ``client_jobs`` makes room only among its own jobs.
            unchanged: shards whose bytes a committed copy of this (job, rank) already holds:
                with ``base_step``, that step's shard of the same name, size, dtype and shape
                (with ``base_generation``, only if the step is still that save);
                with ``checksums`` (shard -> checksum, an inbound replica), the newest committed
                step holding the same name, size, dtype, shape and checksum. Such a file is
                hard-linked into the staging area (``StagedFile.shared``: nothing is written)
                instead of staged anew; any other shard is staged as usual (the hint never
                changes the bytes committed).

        Raises:
            InvalidArgumentError: a field is invalid (the message names it).
            CapacityError: the shards do not fit even after eviction, or too many saves are open.
        """
        share = share_fn(self._catalog, unchanged, base_step, checksums, base_generation)
        st = self._saves.begin(job, step, rank, world_size, specs, stream=stream,
                               prefault=self.warm.prefaulter(prefault), evictable=evictable, share=share,
                               inbound=prefault, job_owner=job_owner)
        if KNOBS.debug_begin_delay:  # test hook: the staging area exists, its caller has no answer yet
            time.sleep(KNOBS.debug_begin_delay)
        return st

    def get_staging(self, save_id: str) -> Staging:
        return self._saves.get(save_id)

    def open_staged(self, save_id: str, shard: str, flags: int = os.O_WRONLY) -> int:
        """A descriptor of an open save's staging file (O_NOFOLLOW; a regular file of its size), for
        a daemon-side writer (streamed chunks, peer bulk receive). The caller closes it.

        Raises:
            InvalidArgumentError: not an open save, or not one of its shards.
            FailedPreconditionError: the staging file was replaced.
        """
        return self._saves.open_staged(save_id, shard, flags)

    def write_chunk(self, save_id: str, shard: str, offset: int, data: bytes | memoryview, fd_cache: dict) -> None:
        """Write streamed bytes into a staging file (stream transfers). ``fd_cache`` maps paths to fds."""
        self._saves.write_chunk(save_id, shard, offset, data, fd_cache)

    def commit(self, save_id: str, digests: dict[str, str], metadata_json: str = "{}", *, persist: bool = False,
               verify: bool = False, node: str | None = None, generation: str | None = None,
               created: float | None = None, pin: str | None = None) -> tuple[Manifest, list[Eviction]]:
        """Publish an open save: move its files into place and write the manifest last.

        Only regular files of exactly the declared size, with one link, are accepted (checked on a
        no-follow open, and again after the rename into place).

        Args:
            digests: checksum per shard, as computed by the writer.
            verify: hash the staged bytes here and compare (stream transfers, peer receive,
                object-store download). A mismatch aborts the save and raises DataLossError.
            node, generation, created: kept from the source manifest when ingesting a copy.
            pin: pin the step with this reason in the same critical section as the commit, so
                retention cannot evict it before a background tier has taken it (see :meth:`pin`).

        Returns:
            The manifest and the evictions that retention made afterwards.

        Raises:
            FailedPreconditionError: a staging file was replaced (symlink, other file, resized).
        """
        st = self.get_staging(save_id)
        man, evictions = self._committer.commit(st, digests, metadata_json, persist=persist, verify=verify,
                                                node=node or self.node_id, generation=generation, created=created,
                                                pin=pin, fsync=self.fsync)
        self._notify(evictions)
        if self.reserve.target:  # the reserve holds what pool warming would add (see .reserve)
            self.reserve.kick()
        else:
            self.warm.committed()
        return man, evictions

    def abort(self, save_id: str) -> None:
        """Drop an open save and its staging files. Idempotent."""
        self._saves.abort(save_id)
        self.warm.warmer.poke()
        self.reserve.poke()

    def is_open(self, save_id: str) -> bool:
        """Whether ``save_id`` is an open save (begun, not yet committed, aborted or reclaimed)."""
        return self._saves.is_open(save_id)

    def abort_staging(self, st: Staging) -> None:
        """:meth:`abort` by the staging area :meth:`begin` returned."""
        self.abort(st.save_id)

    def reclaim_expired(self, timeout: float) -> int:
        """Abort saves open longer than ``timeout`` seconds (a client that died mid-save)."""
        n = self._saves.reclaim_expired(timeout)
        if n:
            self.warm.warmer.poke()
            self.reserve.poke()
        return n

    def open_saves(self) -> int:
        return self._saves.count()

    def saving(self) -> bool:
        """Whether a save is open or committing here (a snapshot, without the lock)."""
        return self._saves.busy()

    def watch_saving(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(saving)`` whenever :meth:`saving` changes, under the lock (no blocking)."""
        with self._lock:
            self._saves.watch.listeners.append(fn)

    def unwatch_saving(self, fn: Callable[[bool], None]) -> None:
        with self._lock:
            if fn in self._saves.watch.listeners:
                self._saves.watch.listeners.remove(fn)

    # ----------------------------------------------------------------------------- reading

    def lend(self, man: Manifest) -> list[Path]:
        """Paths of a rank's data files for a reader to map: one loan, ended by :meth:`release`;
        the files are not recycled while a loan is open (see :mod:`.recycle`)."""
        paths = [self.shard_path(man, s.name) for s in man.shards]
        with self._lock:
            self._recycle.lend((man.job, man.step, man.rank, man.generation), paths)
        return paths

    def release(self, job: str, step: int, rank: int, generation: str) -> bool:
        """End one loan of :meth:`lend`; False when none of that copy is open."""
        with self._lock:
            return self._recycle.unlend((job, step, rank, generation))

    def usage(self) -> Usage:
        with self._lock:
            staging = self._saves.data_bytes_locked()
            committed = self._catalog.data_bytes + self._catalog.links.data_bytes
            r = self.reserve
            return Usage(self.capacity, committed, staging, self._recycle.data_bytes,
                         charged=self._used_locked(), warm=self._recycle.warm_bytes,
                         staging_charged=self._saves.charged_locked(), recycle_charged=self._recycle.bytes,
                         reserve=r.data_bytes, reserve_charged=r.bytes, reserve_target=r.target,
                         reserve_ready=r.ready_bytes, reserve_taken=r.taken_bytes)

    def _used_locked(self) -> int:
        return (self._catalog.committed_bytes + self._catalog.links.charged + self._saves.charged_locked()
                + self._recycle.bytes + self.reserve.bytes + self.external_charge())
