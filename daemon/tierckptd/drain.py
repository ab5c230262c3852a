"""The persistent tier: drain selected steps to an object store, restore from it.

Selection: a rank committed on this node is drained when its save asked for it (``persist=True``)
or ``persist_every > 0 and step % persist_every == 0``. Each node drains the ranks it owns
(``manifest.node == node_id``); replicas from peers and copies downloaded from the persistent
tier (``ingested=True``) are not drained, except by a take-over.

Take-over: a node remembers (in memory; rebuilt from the local store at start) the selected
copies it holds of other owners' ranks. When the peer tier has seen the owner down for
:data:`TAKEOVER_GRACE` seconds and the rank's manifest is still missing from the persistent tier
(or only an older save of it is there), the first node on the ring after the owner among this
node and the live peers holding the same generation queues the copy in its durable queue and
drains it the normal way (pin, shards, manifest last); the others keep waiting, and take over in
turn if that node goes down too. A taken-over rank is uploaded under the owner's object names
(``<shard>.<generation>``, the owner's save id) with the owner's manifest unchanged, so the
objects and manifest it writes are byte for byte those the owner writes: a recovering owner
that drains the same save concurrently, or two nodes that both decided to take over (their
health views differ), only overwrite identical objects, and neither's stale-object cleanup
removes what the other's manifest names. Selection of a copy uses this node's ``persist_every``
(the same on every node of a cluster) and the save's ``persist`` flag.

Object layout below the URL's root (``file:///dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``)::

    <job>/data/<step:020d>/rank-<rank:07d>/<shard>.<save-id>                 shard bytes
    <job>/manifests/<step:020d>/rank-<rank:07d>-of-<world:07d>.json          commit marker

The manifest object is the local per-rank manifest JSON unchanged: its ``shards[].file`` fields
name the data objects of the rank (``<shard>.<save-id>``, so a re-save never overwrites bytes
that an older manifest still names). It is uploaded only after every data object of the rank is
stored, so a reader never sees a rank whose shards are missing or partial. A step is complete in
this tier when every rank ``0..world-1`` has a manifest. Manifests live under their own prefix
and carry the world size in their name, so the catalog of a job is one listing, with no reads.

Durable queue: one JSON file per pending rank, ``<local_dir>/drain-queue/<job>.<step:020d>.<rank:07d>.json``
holding ``{"format": 1, "job", "step", "rank", "generation", "enqueued"}``, written under a
temporary name and renamed (flushed when the local tier flushes), removed once the manifest is
uploaded. A restarted daemon re-queues every entry whose rank is still in the local store. While
queued, the step is pinned in the local store (``store.pin(job, step, "drain")``): retention skips
it; only capacity may evict it, and then the entry fails loudly (logged, counted in
``drain_failures``) rather than retrying forever.

Retries: every upload retries throttling, 5xx and connection errors with capped exponential
backoff and full jitter for as long as they last (an outage delays drains, loses nothing); a
non-retryable error (access denied, missing bucket) fails the attempt, makes ``wait`` raise
``TierError`` naming it, and the rank is tried again every :data:`FAILED_RETRY_SECONDS`.

Retention (``keep_persistent`` N > 0): after a drain, steps older than the N-th newest complete
step are deleted, manifests first, then data.

Restore (``fetch``): the rank's manifest is read, the shards are downloaded in parallel (each
large object in parallel ranges by its backend) into staging files of the local store, and the
local commit verifies every checksum; a copy that fails is discarded and counted, never returned.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import re
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from tierckpt.common.fileio import atomic_write
from tierckpt.common.names import check_shard
from tierckpt.errors import (
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    TierError,
    UnavailableError,
)

from .backends import Backend, BackendError, MissingExtraError, open_backend
from .config import ConfigError, DaemonConfig
from .manifest import Manifest, ShardEntry
from .retry import RetryPolicy, call_with_retry
from .store import Eviction, LocalStore
from .tiers import RankCopy, RemoteTier

__all__ = [
    "PersistentTier", "DrainQueue", "selected", "not_selected_reason", "plan_retention",
    "manifest_key", "data_key", "parse_manifest_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Key = tuple[str, int, int]

UPLOAD_THREADS = 8
"""Shard uploads in flight at once (each S3 upload also splits into parts on the backend's pool)."""
RANKS_AT_ONCE = 4
"""Ranks drained concurrently; their shards share the upload threads."""
READ_THREADS = 16
"""Backend reads in flight at once (restore downloads, catalog listings, manifests)."""
FAILED_RETRY_SECONDS = 60.0
"""Delay before a rank whose upload failed with a non-retryable error is tried again."""
CATALOG_TTL = 2.0
"""Seconds a job's persistent catalog is reused, so ``latest()`` stays cheap."""
CATALOG_WAIT = 5.0
"""Seconds ``catalog`` waits for a listing before answering from the previous one."""
TAKEOVER_GRACE = 10.0
"""Seconds a rank's owner must be seen down before a holder of a copy drains the rank instead."""
TAKEOVER_CHECK_INTERVAL = 1.0
"""Seconds between two looks at the owners of the copies this node holds."""

DRAIN_RETRY = RetryPolicy(initial_delay=0.5, max_delay=30.0, deadline=None)
READ_RETRY = RetryPolicy(initial_delay=0.2, max_delay=5.0, deadline=60.0)
CATALOG_RETRY = RetryPolicy(initial_delay=0.2, max_delay=1.0, max_attempts=3, deadline=5.0)

_QUEUE_DIR = "drain-queue"
_QUEUE_FORMAT = 1
_MANIFEST_RE = re.compile(r"^manifests/(\d{20})/rank-(\d{7})-of-(\d{7})\.json$")


# --------------------------------------------------------------------------------- pure planning


def manifest_key(job: str, step: int, rank: int, world_size: int) -> str:
    """Object key of a rank's manifest (the commit marker)."""
    return f"{job}/manifests/{step:020d}/rank-{rank:07d}-of-{world_size:07d}.json"


def _manifest_rank_prefix(job: str, step: int, rank: int) -> str:
    return f"{job}/manifests/{step:020d}/rank-{rank:07d}-of-"


def data_key(job: str, step: int, rank: int, shard: ShardEntry) -> str:
    """Object key of one shard's bytes (``shard.file`` is ``<name>.<save-id>``)."""
    if not shard.file:
        raise DataLossError(f"manifest of {job} step {step} rank {rank}: shard {shard.name!r} names no object")
    return f"{job}/data/{step:020d}/rank-{rank:07d}/{shard.file}"


def parse_manifest_key(job: str, key: str) -> tuple[int, int, int] | None:
    """``(step, rank, world_size)`` of a manifest key of ``job``, or None for any other key."""
    head = job + "/"
    if not key.startswith(head):
        return None
    m = _MANIFEST_RE.match(key[len(head):])
    if m is None:
        return None
    step, rank, world = (int(g) for g in m.groups())
    return (step, rank, world) if 0 <= rank < world else None


def selected(man: Manifest, persist_every: int) -> bool:
    """Whether a committed rank goes to the persistent tier."""
    return man.persist or (persist_every > 0 and man.step % persist_every == 0)


def not_selected_reason(man: Manifest, persist_every: int) -> str:
    """The message ``wait`` gives for a rank that is not drained."""
    return (f"{man.job} step {man.step} is not selected for the persistent tier: "
            f"persist_every={persist_every} and persist=False")


def plan_retention(steps: Mapping[int, Mapping[int, int]], keep: int) -> list[int]:
    """Steps to delete so that ``keep`` complete steps remain (oldest complete kept included).

    Args:
        steps: step -> rank -> world size, as found in the persistent tier.
        keep: newest complete steps to keep; 0 keeps everything.

    Returns:
        Every step older than the ``keep``-th newest complete step, ascending (complete or not).
    """
    if keep <= 0:
        return []
    complete = sorted(s for s, ranks in steps.items()
                      if ranks and len(set(ranks.values())) == 1 and len(ranks) == next(iter(ranks.values())))
    if len(complete) <= keep:
        return []
    cutoff = complete[-keep]
    return sorted(s for s in steps if s < cutoff)


# --------------------------------------------------------------------------------- durable queue


class DrainQueue:
    """Pending drains, one small JSON file per rank (see the module docstring).

    Args:
        root: the queue directory (``<local_dir>/drain-queue``); created if missing.
        fsync: flush each entry and the directory (when the local tier is on a durable medium).
    """

    def __init__(self, root: Path, *, fsync: bool) -> None:
        self.root = root
        self.fsync = fsync

    def _path(self, job: str, step: int, rank: int) -> Path:
        return self.root / f"{job}.{step:020d}.{rank:07d}.json"

    def put(self, man: Manifest, enqueued: float) -> None:
        """Record (or replace) the entry for ``man``'s rank, atomically."""
        doc = {"format": _QUEUE_FORMAT, "job": man.job, "step": man.step, "rank": man.rank,
               "generation": man.generation, "enqueued": enqueued}
        atomic_write(self._path(man.job, man.step, man.rank), json.dumps(doc, sort_keys=True).encode(),
                     fsync=self.fsync)

    def remove(self, job: str, step: int, rank: int) -> None:
        self._path(job, step, rank).unlink(missing_ok=True)

    def load(self) -> list[dict[str, Any]]:
        """Every entry, oldest first; temporary leftovers and unreadable entries are removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        out = []
        for p in self.root.iterdir():
            if p.name.startswith(".") or not p.name.endswith(".json"):
                p.unlink(missing_ok=True)
                continue
            try:
                doc = json.loads(p.read_bytes())
                named = self._path(doc["job"], int(doc["step"]), int(doc["rank"]))
                if doc.get("format") != _QUEUE_FORMAT or p != named:
                    raise ValueError("unexpected format or name")
                doc["enqueued"] = float(doc["enqueued"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("drain queue: dropping unreadable entry %s: %s", p, e)
                p.unlink(missing_ok=True)
                continue
            out.append(doc)
        return sorted(out, key=lambda d: (d["enqueued"], d["step"], d["rank"]))


# --------------------------------------------------------------------------------- the tier


class _Stopped(Exception):
    """Raised inside a worker thread's retry sleep when the tier stops or the entry is cancelled."""


@dataclass(eq=False)
class _Entry:
    man: Manifest  # the local manifest to drain (replaced by a re-save of the same rank)
    enqueued: float  # wall clock, kept across restarts
    running: bool = False
    not_before: float = 0.0  # monotonic: earliest next attempt after a non-retryable failure
    error: str = ""  # last non-retryable failure, reported by wait()
    cancelled: bool = False  # evicted or superseded: threads stop retrying


class _Bounded(collections.OrderedDict):
    """An insertion-ordered dict that forgets its oldest items beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class PersistentTier(RemoteTier):
    """Drains selected ranks to the object store at ``config.persistent`` and restores from it.

    See the module docstring for selection, layout, queue, retries and retention; the call order
    is :class:`~tierckptd.tiers.RemoteTier`'s.

    Args:
        config: the daemon configuration (``persistent``, ``persist_every``, ``keep_persistent``,
            ``node_id``, ``local_dir``).
        store: the opened local store.
        metrics: optional :class:`~tierckptd.metrics.Metrics`.
        backend: an already opened backend (tests, benchmarks); default: ``open_backend(url)`` at start.
    """

    name = "persistent"

    def __init__(self, config: DaemonConfig, store: LocalStore, metrics: Any = None, *,
                 backend: Backend | None = None) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.url = config.persistent
        self.backend = backend
        self.queue = DrainQueue(store.root / _QUEUE_DIR, fsync=store.fsync)
        self._node: Any = None
        self._pending: dict[Key, _Entry] = {}
        self._recent: _Bounded = _Bounded(65536)  # key -> generation drained by this process
        self._failed: _Bounded = _Bounded(4096)  # key -> (generation, reason) of permanent failures
        self._known: _Bounded = _Bounded(65536)  # key -> (nbytes, created) of manifests seen here
        self._copies: _Bounded = _Bounded(65536)  # key -> selected copy of another owner's rank held here
        self._down_since: dict[str, float] = {}  # owner -> monotonic time it was first seen down
        # job -> (listed at, epoch, step -> rank -> world or None, error); stale once the epoch moved
        self._catalogs: dict[str, tuple[float, int, dict[int, dict[int, int]] | None, str]] = {}
        self._epochs: dict[str, int] = collections.defaultdict(int)
        self._listings: dict[str, tuple[int, asyncio.Task]] = {}  # job -> (epoch, listing in flight)
        self._fetch_locks: weakref.WeakValueDictionary[Key, asyncio.Lock] = weakref.WeakValueDictionary()
        self._retention_locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._uploads = asyncio.Semaphore(UPLOAD_THREADS)
        self._reads = asyncio.Semaphore(READ_THREADS)
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._halt = threading.Event()
        self._stopping = False
        self._threads = 0
        self._threads_lock = threading.Lock()
        self._running: set[asyncio.Task] = set()
        self._tasks: set[asyncio.Task] = set()

    # ----------------------------------------------------------------------------- lifecycle

    def bind(self, host: Any) -> None:  # interim, until the persistent package lands
        super().bind(host)
        self.attach(host)

    def attach(self, node: Any) -> None:
        """Called by main with the :class:`~tierckptd.node.Node`, to announce downloaded copies
        and to read the peer tier's health view (``node.tier("peer")``) for take-overs."""
        self._node = node

    async def start(self) -> None:
        """Open the backend, resume the durable queue and start the drain loop.

        Raises:
            ConfigError: the URL is malformed, its SDK is missing or its client cannot be made.
        """
        if self.backend is None:
            try:
                self.backend = await asyncio.to_thread(open_backend, self.url)
            except (MissingExtraError, BackendError) as e:
                raise ConfigError(f"persistent: {e}") from e
        resumed = dropped = 0
        for doc in await asyncio.to_thread(self.queue.load):
            job, step, rank = doc["job"], int(doc["step"]), int(doc["rank"])
            man = self.store.get(job, step, rank)
            if man is None:
                dropped += 1
                log.error("drain of %s step %d rank %d abandoned: the rank left the local tier before it was "
                          "drained (daemon restarted)", job, step, rank)
                self._failed[(job, step, rank)] = (doc.get("generation"), "left the local tier before it was drained")
                self._count_failure(final=True)
                self.queue.remove(job, step, rank)
                continue
            self._enqueue(man, doc["enqueued"], durable=False)
            resumed += 1
        log.info("persistent tier %s: %d pending drains resumed, %d abandoned", self.url, resumed, dropped)
        for job in self.store.jobs():  # copies held before a restart may still need a take-over
            for ranks in self.store.steps(job).values():
                for man in ranks.values():
                    if man.node != self.config.node_id and man.key not in self._pending:
                        self._note_copy(man)
        self._spawn(self._scheduler())
        self._spawn(self._ticker())
        self._spawn(self._watch_copies())

    async def stop(self, timeout: float) -> None:
        """Let in-flight uploads finish within ``timeout``; queued ranks stay in the durable queue."""
        self._stopping = True
        self._wake.set()
        if self._running:
            done, pending = await asyncio.wait(set(self._running), timeout=timeout)
            if pending:
                log.warning("shutdown: %d drains still uploading after %.0fs; they resume at the next start",
                            len(pending), timeout)
        self._halt.set()
        for t in self._running | self._tasks:
            t.cancel()
        log.info("persistent tier stopped: %d ranks left in the drain queue", len(self._pending))
        if self.backend is not None and self._threads == 0:
            self.backend.close()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ----------------------------------------------------------------------------- selection

    def commit_pin(self, job: str, step: int, persist: bool) -> str | None:
        """Pin a selected step at commit time, so retention cannot evict it before it is queued."""
        every = self.config.persist_every
        return "drain" if persist or (every > 0 and step % every == 0) else None

    def on_commit(self, manifest: Manifest, *, ingested: bool) -> None:
        """Queue the rank if this node owns it and it is selected; remember a selected copy of
        another owner's rank for a possible take-over (see the module docstring)."""
        if manifest.node != self.config.node_id:
            if ingested:
                self._note_copy(manifest)
            return
        if ingested:
            return
        self._select(manifest)

    def _note_copy(self, man: Manifest) -> None:
        if man.key in self._pending:  # taken over: follow a re-save as the owner would
            self._select(man)
        elif selected(man, self.config.persist_every):
            self._copies[man.key] = man
        else:
            self._copies.pop(man.key, None)

    def _select(self, manifest: Manifest) -> None:
        key = manifest.key
        if not selected(manifest, self.config.persist_every):
            e = self._pending.get(key)
            if e is not None:  # a re-save that is not selected supersedes the queued one
                self._fail(e, "superseded by a re-save that is not selected for the persistent tier")
            return
        self._enqueue(manifest, time.time(), durable=True)

    def _enqueue(self, man: Manifest, enqueued: float, *, durable: bool) -> None:
        e = self._pending.get(man.key)
        if e is not None:
            e.man = man  # a re-save: the worker notices the new generation and drains it instead
            e.error, e.not_before = "", 0.0
        else:
            self._pending[man.key] = _Entry(man, enqueued)
        self._recent.pop(man.key, None)
        self._failed.pop(man.key, None)
        if durable:
            try:
                self.queue.put(man, enqueued)
            except OSError as err:  # the drain still runs; only a restart before it ends would lose it
                log.error("drain queue: cannot record %s step %d rank %d in %s: %s; this drain does not "
                          "survive a restart", man.job, man.step, man.rank, self.queue.root, err)
        self.store.pin(man.job, man.step, "drain")
        if self.store.get(*man.key) is None:  # evicted between the commit and this call
            self._fail(self._pending[man.key], "evicted from the local tier before it was drained")
            return
        self._update_gauges()
        self._wake.set()

    def on_evict(self, eviction: Eviction) -> None:
        """A queued rank evicted before its drain fails now (the store logged it loudly)."""
        for rank in eviction.ranks:
            self._copies.pop((eviction.job, eviction.step, rank), None)
            e = self._pending.get((eviction.job, eviction.step, rank))
            if e is not None:
                self._fail(e, f"evicted from the local tier before it was drained ({eviction.reason})")

    # ----------------------------------------------------------------------------- draining

    async def _scheduler(self) -> None:
        while not self._stopping:
            self._wake.clear()
            now = time.monotonic()
            idle = sorted((e for e in self._pending.values() if not e.running),
                          key=lambda e: (e.enqueued, e.man.step, e.man.rank))
            for e in idle:
                if len(self._running) >= RANKS_AT_ONCE:
                    break
                if e.not_before <= now:
                    e.running = True
                    task = asyncio.create_task(self._drain(e))
                    self._running.add(task)
                    task.add_done_callback(self._drain_done)
            delays = [e.not_before - now for e in self._pending.values() if not e.running and e.not_before > now]
            try:
                await asyncio.wait_for(self._wake.wait(), min(delays) if delays else None)
            except asyncio.TimeoutError:
                pass

    def _drain_done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._wake.set()

    async def _drain(self, e: _Entry) -> None:
        """One attempt at one rank; the outcome is recorded on the entry (task boundary)."""
        man = e.man
        try:
            uploaded = await self._upload(e, man)
        except _Stopped:
            return
        except (BackendError, OSError) as err:
            current = self.store.get(*man.key)
            if self._pending.get(man.key) is not e:
                return  # failed meanwhile (evicted): already reported
            if current is None:
                self._fail(e, f"left the local tier before it was drained ({err})")
            elif current.generation == man.generation:
                e.error = str(err) or type(err).__name__
                e.not_before = time.monotonic() + FAILED_RETRY_SECONDS
                self._count_failure(final=False)
                log.error("drain of %s step %d rank %d to %s failed: %s; trying again in %.0fs",
                          man.job, man.step, man.rank, self.url, e.error, FAILED_RETRY_SECONDS)
                self._broadcast()
            return  # else: superseded by a re-save; the next attempt drains the new generation
        except asyncio.CancelledError:
            raise
        except Exception:  # task boundary: a bug must not kill the drain loop silently
            log.exception("drain of %s step %d rank %d crashed; trying again later", man.job, man.step, man.rank)
            e.not_before = time.monotonic() + FAILED_RETRY_SECONDS
            return
        finally:
            e.running = False
        if uploaded and self._pending.get(man.key) is e and e.man.generation == man.generation:
            await self._finish(e)

    async def _upload(self, e: _Entry, man: Manifest) -> bool:
        """Upload a rank's shards, then its manifest. Returns False if a re-save superseded it."""
        job, step, rank = man.key
        paths = [self.store.shard_path(man, s.name) for s in man.shards]
        local, man = man, self._owner_form(man)
        await asyncio.gather(*(self._put_shard(e, data_key(job, step, rank, s), p, s.size)
                               for s, p in zip(man.shards, paths)))
        # Every byte above was read while the rank was still committed here (eviction removes it
        # from the catalog before touching its files), unless this check fails.
        current = self.store.get(job, step, rank)
        if current is None:
            raise FileNotFoundError(f"{job} step {step} rank {rank} is no longer in the local tier")
        if current.generation != man.generation:
            return False
        if local is not man and await self._newer_in_store(man):
            log.info("take-over of %s step %d rank %d: a newer save of it is in %s; not replacing it",
                     job, step, rank, self.url)
            return True
        await self._write(e, functools.partial(self.backend.put_bytes,
                                               manifest_key(job, step, rank, man.world_size), man.to_json()))
        await self._remove_stale(e, man)
        return True

    def _owner_form(self, man: Manifest) -> Manifest:
        """A copy of another owner's rank as its owner uploads it: data files named ``<shard>.<generation>``
        (the owner's save id), so a take-over and the owner write the same objects and manifest."""
        if man.node == self.config.node_id:
            return man
        try:
            shards = tuple(dataclasses.replace(s, file=check_shard(f"{s.name}.{man.generation}"))
                           for s in man.shards)
        except InvalidArgumentError:  # an odd generation from a peer: keep this copy's own names
            return man
        return dataclasses.replace(man, shards=shards)

    async def _newer_in_store(self, man: Manifest) -> bool:
        """Whether the persistent tier holds another, newer save of the rank (a recovered owner's)."""
        try:
            remote = await self._read_manifest(*man.key)
        except (NotFoundError, DataLossError, UnavailableError):
            return False
        return remote.generation != man.generation and remote.created > man.created

    # ----------------------------------------------------------------------------- take-over

    async def _watch_copies(self) -> None:
        while not self._stopping:
            await asyncio.sleep(TAKEOVER_CHECK_INTERVAL)
            try:
                await self._check_copies()
            except asyncio.CancelledError:
                raise
            except Exception:  # task boundary: keep watching
                log.exception("persistent tier: checking the owners of held copies failed")

    async def _check_copies(self) -> None:
        """Take over the drain of copies whose owner has been down for TAKEOVER_GRACE seconds."""
        peer = getattr(self._node.tier("peer"), "cluster", None) if self._node is not None else None
        if peer is None or not hasattr(peer, "is_up"):
            return
        now = time.monotonic()
        owners = {m.node for m in self._copies.values()}
        for owner in owners:
            if peer.is_up(owner):
                self._down_since.pop(owner, None)
            else:
                self._down_since.setdefault(owner, now)
        for owner in [o for o in self._down_since if o not in owners]:
            del self._down_since[owner]
        due = []
        for key, man in list(self._copies.items()):
            since = self._down_since.get(man.node)
            if since is None or now - since < TAKEOVER_GRACE:
                continue
            local = self.store.get(*key)
            if key in self._pending or local is None or local.generation != man.generation:
                self._copies.pop(key, None)
                continue
            # Only the first holder after the owner on the ring (of those alive) takes over.
            holders = [n for n in (self.config.node_id, *peer.live_holders(man.key, man.generation)) if n != man.node]
            if min(holders, key=lambda n: (n < man.node, n)) == self.config.node_id:
                due.append(man)
        if due:
            await asyncio.gather(*(self._take_over(peer, man, now - self._down_since[man.node]) for man in due))

    async def _take_over(self, peer: Any, man: Manifest, down_for: float) -> None:
        try:
            remote = await self._read_manifest(*man.key)
        except (NotFoundError, DataLossError):  # missing, or corrupt: a fresh upload replaces it
            remote = None
        except UnavailableError as err:
            log.warning("take-over of %s step %d rank %d postponed: %s", man.job, man.step, man.rank, err)
            return
        if self._copies.get(man.key) is not man or man.key in self._pending or peer.is_up(man.node):
            return  # changed meanwhile; looked at again on the next pass
        del self._copies[man.key]
        if remote is not None and (remote.generation == man.generation or remote.created >= man.created):
            return  # drained by its owner (or a newer save is there)
        local = self.store.get(*man.key)
        if local is None or local.generation != man.generation:
            return
        log.warning("taking over the drain of %s step %d rank %d to %s: its owner %s has been down for %.0fs "
                    "and it is not in the persistent tier", man.job, man.step, man.rank, self.url, man.node,
                    down_for)
        self._enqueue(local, time.time(), durable=True)

    async def _put_shard(self, e: _Entry, key: str, path: Path, size: int) -> None:
        def put() -> int:
            if self.backend.exists(key):  # uploaded before a restart: object names are per generation
                return 0
            self.backend.put_file(key, path)
            return size

        sent = await self._write(e, put)
        if sent and self.metrics:
            self.metrics.drained_bytes.inc(sent)

    async def _remove_stale(self, e: _Entry, man: Manifest) -> None:
        """Delete what older saves of this rank left: other manifests first, then unnamed data."""
        job, step, rank = man.key
        keep_manifest = manifest_key(job, step, rank, man.world_size)
        manifests = await self._write(e, functools.partial(self.backend.list, _manifest_rank_prefix(job, step, rank)))
        stale = [k for k in manifests if k != keep_manifest]
        if stale:
            await self._write(e, functools.partial(self.backend.delete, stale))
        keep = {data_key(job, step, rank, s) for s in man.shards}
        data = await self._write(e, functools.partial(self.backend.list, f"{job}/data/{step:020d}/rank-{rank:07d}/"))
        stale = [k for k in data if k not in keep]
        if stale:
            await self._write(e, functools.partial(self.backend.delete, stale))

    async def _finish(self, e: _Entry) -> None:
        man = e.man
        self._pending.pop(man.key, None)
        self.queue.remove(*man.key)  # here, not in a thread: a re-save may queue the same name next
        self._recent[man.key] = man.generation
        self._known[man.key] = (man.nbytes, man.created)
        self._invalidate(man.job)
        if self.metrics:
            self.metrics.saves.labels(tier="persistent", result="ok").inc()
            self.metrics.saved_bytes.labels(tier="persistent").inc(man.nbytes)
        log.info("drained %s step %d rank %d (%d bytes) to %s in %.1fs", man.job, man.step, man.rank, man.nbytes,
                 self.url, time.time() - e.enqueued)
        self._update_gauges()
        await self._unpin(man.job, man.step)  # before waiters return: retention has run when they look
        self._broadcast()
        if self.config.keep_persistent:
            self._spawn(self._retain(man.job))

    def _fail(self, e: _Entry, reason: str) -> None:
        """Give up on a queued rank for good (evicted or superseded): log, count, forget."""
        man = e.man
        if self._pending.get(man.key) is not e:
            return
        e.cancelled = True
        del self._pending[man.key]
        self._failed[man.key] = (man.generation, reason)
        self.queue.remove(*man.key)
        self._count_failure(final=True)
        log.error("drain of %s step %d rank %d to %s failed: %s", man.job, man.step, man.rank, self.url, reason)
        self._update_gauges()
        self._broadcast()
        self._spawn(self._unpin(man.job, man.step))
        self._spawn(self._forget_orphans(man))

    async def _forget_orphans(self, man: Manifest) -> None:
        """Best effort: delete data objects uploaded for a rank whose drain was abandoned.

        Nothing is deleted if the rank's manifest in the store names this very save (it was
        drained before a restart re-queued it), or if that cannot be checked.
        """
        keys = [data_key(man.job, man.step, man.rank, s) for s in man.shards]
        try:
            try:
                if (await self._read_manifest(*man.key)).generation == man.generation:
                    return
            except NotFoundError:
                pass
            await self._read(functools.partial(self.backend.delete, keys), CATALOG_RETRY)
        except (BackendError, UnavailableError, DataLossError) as err:
            log.warning("could not delete the partial upload of %s step %d rank %d: %s",
                        man.job, man.step, man.rank, err)

    def _invalidate(self, job: str) -> None:
        """Our own drain or deletion changed the job's objects: the next catalog lists again."""
        self._epochs[job] += 1

    def _has_pending(self, job: str, step: int) -> bool:
        return any(k[0] == job and k[1] == step for k in self._pending)

    async def _unpin(self, job: str, step: int) -> None:
        """Release the step's drain pin once none of its ranks is queued (the pin is per step)."""
        if self._has_pending(job, step):
            return
        await asyncio.to_thread(self.store.unpin, job, step, "drain")
        if self._has_pending(job, step):  # re-saved and queued meanwhile
            self.store.pin(job, step, "drain")

    def _count_failure(self, *, final: bool) -> None:
        if self.metrics:
            self.metrics.drain_failures.inc()
            if final:
                self.metrics.saves.labels(tier="persistent", result="error").inc()

    # ----------------------------------------------------------------------------- retention

    async def _retain(self, job: str) -> None:
        """Keep the newest ``keep_persistent`` complete steps of ``job``: manifests go first."""
        async with self._retention_locks[job]:
            try:
                steps = await self._list_steps(job, CATALOG_RETRY)
                for step in plan_retention(steps, self.config.keep_persistent):
                    manifests = await self._read(functools.partial(
                        self.backend.list, f"{job}/manifests/{step:020d}/"), CATALOG_RETRY)
                    await self._read(functools.partial(self.backend.delete, manifests), CATALOG_RETRY)
                    data = await self._read(functools.partial(
                        self.backend.list, f"{job}/data/{step:020d}/"), CATALOG_RETRY)
                    await self._read(functools.partial(self.backend.delete, data), CATALOG_RETRY)
                    for k in [k for k in self._known if k[0] == job and k[1] == step]:
                        del self._known[k]
                    log.info("keep_persistent=%d: deleted %s step %d from %s (%d objects)",
                             self.config.keep_persistent, job, step, self.url, len(manifests) + len(data))
            except (BackendError, UnavailableError) as err:
                log.warning("persistent retention of %s postponed to the next drain: %s", job, err)
            finally:
                self._invalidate(job)

    # ----------------------------------------------------------------------------- catalog

    async def _list_steps(self, job: str, policy: RetryPolicy) -> dict[int, dict[int, int]]:
        """step -> rank -> world size from one listing of the job's manifests."""
        keys = await self._read(functools.partial(self.backend.list, f"{job}/manifests/"), policy)
        out: dict[int, dict[int, int]] = {}
        for key in keys:
            parsed = parse_manifest_key(job, key)
            if parsed is None:
                continue
            step, rank, world = parsed
            out.setdefault(step, {}).setdefault(rank, world)  # two worlds for a rank: a re-save mid-cleanup
        return out

    async def catalog(self, job: str) -> dict[int, dict[int, RankCopy]]:
        """The ranks of ``job`` with a manifest in the persistent tier (cached for CATALOG_TTL).

        At most one listing per job is in flight; a caller waits for it up to CATALOG_WAIT
        seconds, then answers from the previous listing, so a slow or unreachable object store
        never holds ``latest()`` up for long while the local and peer tiers can answer.

        Raises:
            UnavailableError: no listing has succeeded yet (failed or still running).
        """
        epoch = self._epochs[job]
        cached = self._catalogs.get(job)
        if cached is None or cached[1] != epoch or time.monotonic() - cached[0] > CATALOG_TTL:
            inflight = self._listings.get(job)
            if inflight is None or inflight[0] != epoch:
                inflight = self._listings[job] = (epoch, self._spawn(self._refresh_catalog(job, epoch)))
            try:
                await asyncio.wait_for(asyncio.shield(inflight[1]), CATALOG_WAIT)
            except asyncio.TimeoutError:
                log.warning("persistent catalog of %s: listing %s takes longer than %.0fs; answering without it",
                            job, self.url, CATALOG_WAIT)
            cached = self._catalogs.get(job)
        if cached is None:
            raise UnavailableError(f"persistent tier {self.url}: cannot list {job} yet")
        _, _, steps, error = cached
        if steps is None:
            raise UnavailableError(f"persistent tier {self.url}: cannot list {job}: {error}")
        out: dict[int, dict[int, RankCopy]] = {}
        for step, ranks in steps.items():
            for rank, world in ranks.items():
                nbytes, created = self._known.get((job, step, rank), (0, 0.0))
                out.setdefault(step, {})[rank] = RankCopy(world, (), nbytes, created)
        return out

    async def _refresh_catalog(self, job: str, epoch: int) -> None:
        """List the job's manifests into the cache (a task: errors are recorded, not raised)."""
        try:
            entry = (time.monotonic(), epoch, await self._list_steps(job, CATALOG_RETRY), "")
        except (BackendError, UnavailableError) as err:
            previous = self._catalogs.get(job)
            stale = previous[2] if previous else None
            entry = (time.monotonic(), epoch, stale, str(err))
            log.warning("persistent catalog of %s: listing %s failed: %s%s", job, self.url, err,
                        "; using the previous listing" if stale is not None else "")
        finally:
            if self._listings.get(job, (None,))[0] == epoch:
                del self._listings[job]
        current = self._catalogs.get(job)
        if current is None or current[1] <= epoch:  # a newer listing may have finished first
            self._catalogs[job] = entry

    async def _read_manifest(self, job: str, step: int, rank: int) -> Manifest:
        """The rank's manifest in the persistent tier.

        Raises:
            NotFoundError: there is none.
            DataLossError: it is malformed or names another rank (counted).
            UnavailableError: the store cannot be read.
        """
        try:
            keys = await self._read(functools.partial(self.backend.list, _manifest_rank_prefix(job, step, rank)))
            found: list[Manifest] = []
            for key in keys:
                parsed = parse_manifest_key(job, key)
                if parsed is None:
                    continue
                try:
                    data = await self._read(functools.partial(self.backend.get_bytes, key))
                except NotFoundError:
                    continue  # deleted meanwhile
                found.append(self._check_manifest(key, data, (job, step, rank), parsed[2]))
        except BackendError as err:
            raise UnavailableError(f"persistent tier {self.url}: {err}") from err
        if not found:
            raise NotFoundError(f"{job} step {step} rank {rank} is not in the persistent tier {self.url}")
        return max(found, key=lambda m: m.created)

    def _check_manifest(self, key: str, data: bytes, want: Key, world: int) -> Manifest:
        try:
            man = Manifest.from_json(data)
            if man.key != want or man.world_size != world:
                raise DataLossError(f"it describes {man.job} step {man.step} rank {man.rank}/{man.world_size}")
            for s in man.shards:
                data_key(*want, s)
        except DataLossError as err:
            self._count_checksum_failure()
            log.error("persistent tier: manifest %s%s is corrupt: %s", self.url, key, err)
            raise DataLossError(f"persistent manifest {key} is corrupt: {err}") from err
        return man

    def _count_checksum_failure(self) -> None:
        if self.metrics:
            self.metrics.checksum_failures.labels(tier="persistent").inc()

    # ----------------------------------------------------------------------------- restore

    async def fetch(self, job: str, step: int, rank: int) -> Manifest:
        """Download one rank into the local store, verified, and return its local manifest.

        Raises:
            NotFoundError: the persistent tier has no manifest for the rank.
            DataLossError: the copy failed verification or misses a shard (logged, counted).
            UnavailableError: the store could not be read within the read retry policy.
            CapacityError: the local tier cannot hold the rank.
        """
        key = (job, step, rank)
        lock = self._fetch_locks.get(key)
        if lock is None:
            lock = self._fetch_locks[key] = asyncio.Lock()
        async with lock:
            local = self.store.get(job, step, rank)
            if local is not None:  # a concurrent restore of the same rank brought it
                return local
            remote = await self._read_manifest(job, step, rank)
            try:
                return await self._download(remote)
            except NotFoundError as err:  # a data object vanished: re-saved or deleted meanwhile?
                fresh = await self._read_manifest(job, step, rank)
                if fresh.generation == remote.generation:
                    raise self._missing_data(remote, err) from err
            try:
                return await self._download(fresh)
            except NotFoundError as err:
                raise self._missing_data(fresh, err) from err

    def _missing_data(self, man: Manifest, err: Exception) -> DataLossError:
        self._count_checksum_failure()
        log.error("persistent copy of %s step %d rank %d is missing data: %s", man.job, man.step, man.rank, err)
        return DataLossError(f"persistent copy of {man.job} step {man.step} rank {man.rank} is missing data: {err}")

    async def _download(self, remote: Manifest) -> Manifest:
        """Fetch one rank into the local store (the Node pins the step around a restore)."""
        job, step, rank = remote.key
        specs = [(s.name, s.size, s.dtype, s.shape) for s in remote.shards]
        st = await asyncio.to_thread(self.store.begin, job, step, rank, remote.world_size, specs, stream=False)
        try:
            await asyncio.gather(*(self._get_shard(st, data_key(job, step, rank, s), st.files[s.name].path)
                                   for s in remote.shards))
            local, _ = await asyncio.to_thread(
                self.store.commit, st.save_id, {s.name: s.checksum for s in remote.shards},
                remote.metadata_json, persist=remote.persist, verify=True, node=remote.node,
                generation=remote.generation, created=remote.created)
        except DataLossError as err:  # the commit verified the bytes and aborted
            self._count_checksum_failure()
            log.error("persistent copy of %s step %d rank %d failed verification, discarded: %s",
                      job, step, rank, err)
            raise DataLossError(f"persistent copy in {self.url} failed verification: {err}") from err
        except BaseException:
            await asyncio.to_thread(self.store.abort, st.save_id)
            raise
        self._known[local.key] = (local.nbytes, local.created)
        log.info("restored %s step %d rank %d (%d bytes) from %s", job, step, rank, local.nbytes, self.url)
        if self._node is not None:
            self._node.notify_ingested(local)
        return local

    async def _get_shard(self, st: Any, key: str, path: Path) -> None:
        try:
            await self._read(functools.partial(self.backend.get_file, key, path))
        except BackendError as err:
            raise UnavailableError(f"persistent tier {self.url}: {err}") from err
        st.created = time.monotonic()  # progress: keep the staging reaper away from a long restore

    # ----------------------------------------------------------------------------- waiting

    def _broadcast(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait(self, job: str, step: int, rank: int, timeout: float | None) -> list[str]:
        """Until the rank's manifest is in the persistent tier; returns ``[url]``.

        Raises:
            TierError: the rank is not selected, not owned here, failed for good, or its last
                attempt failed with a non-retryable error (the message names it).
            NotFoundError: the rank is neither committed here nor in the persistent tier.
        """
        key = (job, step, rank)
        while (e := self._pending.get(key)) is not None:
            if e.error:
                raise TierError(f"{job} step {step} rank {rank}: drain to {self.url} failed: {e.error} "
                                f"(tried again every {FAILED_RETRY_SECONDS:.0f}s)")
            changed = self._changed
            await changed.wait()
        local = self.store.get(job, step, rank)
        failed = self._failed.get(key)
        if local is not None:
            if self._recent.get(key) == local.generation:
                return [self.url]
            if failed and failed[0] == local.generation:
                raise TierError(f"{job} step {step} rank {rank}: drain to {self.url} failed: {failed[1]}")
            if not selected(local, self.config.persist_every):
                raise TierError(not_selected_reason(local, self.config.persist_every))
        elif failed:
            raise TierError(f"{job} step {step} rank {rank}: drain to {self.url} failed: {failed[1]}")
        try:
            remote = await self._read_manifest(job, step, rank)
        except NotFoundError:
            if local is None:
                raise NotFoundError(f"{job} step {step} rank {rank} is neither committed on node "
                                    f"{self.config.node_id} nor in the persistent tier") from None
            if local.node != self.config.node_id:
                raise TierError(f"{job} step {step} rank {rank} is drained by its owner, node {local.node}, "
                                f"and is not in the persistent tier yet") from None
            raise TierError(f"{job} step {step} rank {rank} is not queued for the persistent tier on node "
                            f"{self.config.node_id}") from None
        if local is not None and remote.generation != local.generation:
            raise TierError(f"{job} step {step} rank {rank}: the persistent tier holds another save of it")
        return [self.url]

    # ----------------------------------------------------------------------------- status

    def status(self) -> dict:
        """``backlog_bytes``, ``backlog_steps`` (pending ranks), ``oldest_age_seconds``, ``url``."""
        pending = list(self._pending.values())
        oldest = min((e.enqueued for e in pending), default=None)
        return {
            "backlog_bytes": sum(e.man.nbytes for e in pending),
            "backlog_steps": len(pending),
            "oldest_age_seconds": max(0.0, time.time() - oldest) if oldest is not None else 0.0,
            "url": self.url,
            "failing": sum(1 for e in pending if e.error),
        }

    def _update_gauges(self) -> None:
        if self.metrics:
            st = self.status()
            self.metrics.drain_backlog_bytes.set(st["backlog_bytes"])
            self.metrics.drain_oldest_age.set(st["oldest_age_seconds"])

    async def _ticker(self) -> None:
        while True:
            self._update_gauges()
            await asyncio.sleep(1.0)

    # ----------------------------------------------------------------------------- threads

    async def _write(self, e: _Entry, fn: Callable[[], T]) -> T:
        """Run a drain step in a thread, retrying retryable errors until the tier stops."""
        def sleep(delay: float) -> None:
            if self._halt.wait(delay) or e.cancelled:
                raise _Stopped()

        call = functools.partial(call_with_retry, fn, DRAIN_RETRY, on_retry=self._on_retry, sleep=sleep)
        return await self._in_thread(self._uploads, call)

    async def _read(self, fn: Callable[[], T], policy: RetryPolicy = READ_RETRY) -> T:
        def sleep(delay: float) -> None:
            if self._halt.wait(delay):
                raise _Stopped()

        try:
            return await self._in_thread(self._reads, functools.partial(call_with_retry, fn, policy, sleep=sleep))
        except _Stopped:
            raise UnavailableError("daemon is shutting down") from None

    def _on_retry(self, attempt: int, err: BackendError, delay: float) -> None:
        if self.metrics:
            self.metrics.drain_failures.inc()

    async def _in_thread(self, limiter: asyncio.Semaphore, fn: Callable[[], T]) -> T:
        """``fn()`` in a daemon thread (a hung SDK call never blocks the daemon's exit)."""
        async with limiter:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future = loop.create_future()

            def run() -> None:
                try:
                    outcome: tuple[bool, Any] = (True, fn())
                except BaseException as err:  # thread boundary: the awaiting coroutine re-raises it
                    outcome = (False, err)
                finally:
                    with self._threads_lock:
                        self._threads -= 1
                try:
                    loop.call_soon_threadsafe(_resolve, fut, outcome)
                except RuntimeError:
                    pass  # the loop is closed: nobody waits any more

            with self._threads_lock:
                self._threads += 1
            threading.Thread(target=run, name="tierckpt-persistent", daemon=True).start()
            return await fut


def _resolve(fut: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if fut.done():
        return
    ok, value = outcome
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
