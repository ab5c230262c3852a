"""The persistent tier as the node sees it: the :class:`~tierckptd.tiers.RemoteTier` facade.

:class:`PersistentTier` wires the parts of this package together and holds no rule of its own
beyond ``wait``'s reading of them: selection (:mod:`.selection`), the durable queue
(:mod:`.queue`), the drain loop (:mod:`.drainer`) and its uploads (:mod:`.uploader`),
take-over (:mod:`.takeover`), retention (:mod:`.retention`), the catalog (:mod:`.catalog`),
restore (:mod:`.download`), verify (:mod:`.audit`), all calling the object store through :mod:`.calls`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from tierckpt.errors import NotFoundError, TierError, UnavailableError

from ..backends import Backend, BackendError, MissingExtraError, open_backend
from ..cluster import ClusterView
from ..config import ConfigError, DaemonConfig
from ..knobs import KNOBS
from ..local.index import check_job_owner
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from ..offload import run_blocking
from ..tiers import Deleted, RankCopy, RemoteTier, Verified, owned
from .audit import Auditor
from .calls import BackendCalls
from .catalog import Catalog
from .codec import IDENTITY, ShardCodec
from .content import ContentStore
from .download import Restorer
from .drainer import Drainer
from .ledger import Ledger
from .queue import QUEUE_DIR, DrainQueue, QueueWriter
from .retention import Retention
from .selection import not_selected_reason, selected, step_selected
from .takeover import TakeOver
from .tombstone import new_tombstone, write_tombstone
from .uploader import RankUploader

__all__ = ["PersistentTier"]

log = logging.getLogger(__name__)
_PROBES_LEFT_MAX = 64
"""Probe objects remembered for a later delete at most (a probe runs every 30 s, and one is left
only when the store fails between its put and its delete)."""


def _warm_codecs() -> None:
    from .compress import warm

    warm()


class PersistentTier(RemoteTier):
    """Drains selected ranks to the object store at ``config.persistent`` and restores from it.

    See :mod:`tierckptd.persistent` for selection, layout, queue, retries, take-over and
    retention; the call order is :class:`~tierckptd.tiers.RemoteTier`'s.

    Args:
        config: the daemon configuration (``persistent``, ``persist_every``, ``keep_persistent``,
            ``node_id``).
        store: the opened local store.
        metrics: optional :class:`~tierckptd.metrics.Metrics`.
        cluster: the cluster as this node sees it (the peer tier's membership), or None when
            there is no peer tier: then no copy is taken over.
        backend: an already opened backend (tests, benchmarks); default: ``open_backend(url)`` at start.
        codec: a per-shard transform: new shards are stored whole through it (the per-shard layout);
            default: the content layout, compressed per ``config.codec``.
    """

    name = "persistent"
    needs_probe = True
    takes_persist = True

    def __init__(self, config: DaemonConfig, store: LocalStore, metrics: Any = None, *,
                 cluster: ClusterView | None = None, backend: Backend | None = None,
                 codec: ShardCodec = IDENTITY) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.url = config.persistent
        self.cluster = cluster
        self.queue = DrainQueue(store.root / QUEUE_DIR, fsync=store.fsync)
        self._tasks: set[asyncio.Task] = set()
        self._probes_left: list[str] = []
        """Probe objects whose delete failed (the store went away between the put and the
        delete): deleted with the next probe's, so an outage leaves nothing behind."""
        self._probes_lock = threading.Lock()
        """Guards ``_probes_left``: a probe that timed out leaves its thread running, and the next
        probe's thread may run beside it."""
        self.calls = BackendCalls(metrics, backend)
        self.ledger = Ledger()
        self.catalog_cache = Catalog(self.calls, self.url, metrics, self._spawn)
        self.content = ContentStore(store, self.calls, config.codec, metrics, config.node_id)
        self.uploader = RankUploader(store, self.calls, self.catalog_cache, config.node_id, metrics, codec,
                                     self.content if self._content_layout(codec) else None)
        self.writer = QueueWriter(self.queue)
        self.drainer = Drainer(config, store, self.ledger, self.writer, self.uploader, self.catalog_cache,
                               Retention(self.calls, self.catalog_cache, self.keep_persistent, config.node_id,
                                         self.content.collecting),
                               metrics, self._spawn, repair=self._repair_local)
        self.takeover = TakeOver(config.node_id, self.persist_every, store, cluster, self.ledger,
                                 self.catalog_cache, self.drainer)
        self.restorer = Restorer(store, self.calls, self.catalog_cache, metrics, self._announce, self.content)
        self.auditor = Auditor(store, self.calls, self.catalog_cache, self.content, self.url)

    def _content_layout(self, codec: object) -> bool:
        return self.config.persistent_layout == "content" and codec is IDENTITY and not KNOBS.per_shard_layout

    def persist_every(self, job: str) -> int:
        """``persist_every`` of ``job``: its policy, else the daemon's flag."""
        return self.store.policies.persist_every(job, self.config.persist_every)

    def keep_persistent(self, job: str) -> int:
        """``keep_persistent`` of ``job``: its policy, else the daemon's flag."""
        return self.store.policies.keep_persistent(job, self.config.keep_persistent)

    # ----------------------------------------------------------------------------- lifecycle

    def _announce(self, man: Manifest) -> None:
        self.host.notify_ingested(man)

    async def _repair_local(self, man: Manifest) -> bool:
        return await self.host.repair_local(man)  # the node: from a peer's verified copy

    @property
    def backend(self) -> Backend | None:
        """The object store (None before start when none was given)."""
        return self.calls.backend

    async def start(self) -> None:
        """Open the backend, resume the durable queue and start the drain loop.

        Raises:
            ConfigError: the URL is malformed, its SDK is missing or its client cannot be made.
        """
        if self.calls.backend is None:
            try:
                self.calls.backend = await run_blocking(open_backend, self.url)
            except (MissingExtraError, BackendError) as e:
                raise ConfigError(f"persistent: {e}") from e
        self.drainer.resume(await run_blocking(self.queue.load))
        await run_blocking(_warm_codecs)  # before the daemon is ready: no import on the first restore
        self.takeover.note_store()  # copies held before a restart may still need a take-over
        self._spawn(self.drainer.run())
        self._spawn(self._ticker())
        self._spawn(self.takeover.watch())
        self._spawn(self._sweep_temporaries())

    async def _sweep_temporaries(self) -> None:
        """At start-up and every ``stale_tmp_interval``: remove what killed uploads left behind."""
        while True:
            try:
                n = await self.calls.read(functools.partial(self.calls.be.remove_stale_temporaries,
                                                            KNOBS.stale_tmp_seconds), KNOBS.catalog_retry)
                if n:
                    log.warning("removed %d stale temporary upload files from %s", n, self.url)
            except (BackendError, UnavailableError) as e:
                log.warning("could not sweep stale temporary uploads from %s: %s", self.url, e)
            await asyncio.sleep(max(0.05, KNOBS.stale_tmp_interval))

    async def probe(self) -> None:
        """Put and delete a small object under the prefix: credentials, bucket and write permission.

        Runs on the tier's own threads, once, without the drain's retries (the caller repeats it).

        Raises:
            BackendError: the object store refused or failed; the message says why.
        """
        be = self.calls.be
        key = f".tierckpt-probe/{self.config.node_id}.{secrets.token_hex(4)}"  # never a job's key
        left, lock = self._probes_left, self._probes_lock

        def put_delete() -> None:
            be.put_bytes(key, b"tierckpt write probe\n")
            with lock:
                earlier = list(left)
            try:
                be.delete([key, *earlier])
            except BaseException:
                with lock:
                    if len(left) < _PROBES_LEFT_MAX:
                        left.append(key)
                raise
            with lock:  # only those this delete covered: another probe's thread may have added one since
                left[:] = [k for k in left if k not in earlier]

        await run_blocking(put_delete, pool=self.calls.threads)

    async def stop(self, timeout: float) -> None:
        """Let in-flight uploads finish within ``timeout``; queued ranks stay in the durable queue."""
        await self.drainer.stop(timeout)
        self.calls.halt.set()
        self.content.reader.halted()
        for t in self.drainer.running | self._tasks:
            t.cancel()
        try:
            await asyncio.wait_for(self.writer.flush(), max(1.0, timeout))
        except TimeoutError:
            log.warning("shutdown: the drain queue directory %s does not answer", self.queue.root)
        log.info("persistent tier stopped: %d ranks left in the drain queue", len(self.ledger.pending))
        self.calls.stop()
        self.content.reader.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ----------------------------------------------------------------------------- hooks

    def commit_pin(self, job: str, step: int, persist: bool) -> str | None:
        """Pin a selected step at commit time, so retention cannot evict it before it is queued."""
        return "drain" if step_selected(step, persist, self.persist_every(job)) else None

    def on_commit(self, manifest: Manifest, *, ingested: bool) -> None:
        """Queue the rank if this node owns it and it is selected; remember a selected copy of
        another owner's rank for a possible take-over."""
        if manifest.node != self.config.node_id:
            if ingested:
                self.takeover.note_copy(manifest)
            return
        if ingested:
            return
        self.drainer.select(manifest)

    def holds_copy(self, manifest: Manifest) -> bool:
        """This process drained this generation of the rank (what it drained before a restart is
        not known here: such steps count as not safe)."""
        return self.ledger.recent.get(manifest.key) == manifest.generation

    def on_evict(self, eviction: Eviction) -> None:
        """A queued rank evicted before its drain fails now (the store logged it loudly)."""
        self.takeover.on_evict(eviction)
        self.drainer.on_evict(eviction)

    # ----------------------------------------------------------------------------- questions

    async def catalog(self, job: str) -> dict[int, dict[int, RankCopy]]:
        """The ranks of ``job`` with a manifest in the persistent tier (see :mod:`.catalog`)."""
        return await self.catalog_cache.catalog(job)

    async def catalog_with_gaps(self, job: str, job_owner: str | None = None
                                ) -> tuple[dict[int, dict[int, RankCopy]], list[str]]:
        """:meth:`catalog`, naming the store when the answer comes from an earlier listing."""
        copies, gaps = await self.catalog_cache.catalog_with_gaps(job)
        return owned(copies, job_owner), gaps

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        """Download one rank into the local store, verified (see :meth:`.restore.Restorer.fetch`)."""
        return await self.restorer.fetch(job, step, rank, job_owner)

    async def wait(self, job: str, step: int, rank: int, timeout: float | None) -> list[str]:
        """Until the rank's manifest is in the persistent tier; returns ``[url]``.

        Raises:
            TierError: the rank is not selected, not owned here, failed for good, or its last
                attempt failed with a non-retryable error (the message names it).
            NotFoundError: the rank is neither committed here nor in the persistent tier.
        """
        key = (job, step, rank)
        while (e := self.ledger.pending.get(key)) is not None:
            if e.error:
                raise TierError(f"{job} step {step} rank {rank}: drain to {self.url} failed: {e.error} "
                                f"(tried again every {KNOBS.failed_retry_seconds:.0f}s)")
            await self.ledger.changed()
        local = self.store.get(job, step, rank)
        failed = self.ledger.failed.get(key)
        if local is not None:
            if self.ledger.recent.get(key) == local.generation:
                return [self.url]
            if failed and failed[0] == local.generation:
                raise TierError(f"{job} step {step} rank {rank}: drain to {self.url} failed: {failed[1]}")
            every = self.persist_every(job)
            if not selected(local, every) and not self.drainer.forced(local):
                raise TierError(not_selected_reason(local, every))
        elif failed:
            raise TierError(f"{job} step {step} rank {rank}: drain to {self.url} failed: {failed[1]}")
        return await self._wait_in_store(job, step, rank, local)

    async def _wait_in_store(self, job: str, step: int, rank: int, local: Manifest | None) -> list[str]:
        try:
            remote = await self.catalog_cache.read_manifest(job, step, rank)
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

    # ----------------------------------------------------------------------------- operator verbs

    async def delete(self, job: str, step: int, job_owner: str | None = None) -> Deleted:
        """Cancel this node's queued drains of the step, leave its tombstone, wait out the
        attempts in flight (``KNOBS.fanout_deadline`` at most; a later one finds the tombstone),
        then delete every rank's manifest and then the data (see :mod:`.tombstone`, :mod:`.retention`).

        Raises:
            UnavailableError: the store failed; nothing was deleted if the tombstone could not be written.
        """
        if job_owner is not None:  # the bucket's copies of the job are its first owner's
            copies = await self.catalog_cache.catalog(job)
            check_job_owner(job, {c.job_owner for ranks in copies.values() for c in ranks.values()}, job_owner,
                            f"delete a step of in {self.url}")
        gens, running = self.drainer.cancel_step(job, step)
        gens |= {m.generation for m in self.store.steps(job).get(step, {}).values()}
        try:
            await write_tombstone(self.calls, new_tombstone(job, step, gens, self.config.node_id))
            if running:
                await asyncio.wait(running, timeout=KNOBS.fanout_deadline)
            manifests, objects = await self.drainer.retention.delete_step(job, step)
        except BackendError as e:
            raise UnavailableError(f"persistent tier {self.url}: {e}") from e
        return Deleted(copies=manifests, objects=objects)

    async def verify(self, job: str, step: int | None) -> Verified:
        """Download and re-hash the stored ranks (see :mod:`.audit`); a store that cannot be
        listed is named in ``unreachable``."""
        try:
            return Verified(await self.auditor.verify(job, step))
        except (BackendError, UnavailableError) as e:
            return Verified(unreachable=[f"persistent ({e})"])

    def persist(self, manifests: Sequence[Manifest]) -> None:
        """Queue the ranks into the drain queue like selected ones."""
        for man in manifests:
            self.drainer.force(man)

    def status(self) -> dict:
        """``backlog_bytes``, ``backlog_steps`` (pending ranks), ``oldest_age_seconds``, ``url``, ``failing``."""
        return self.ledger.status(self.url)

    async def _ticker(self) -> None:
        while True:
            self.drainer.update_gauges()
            await asyncio.sleep(1.0)
