"""The drain loop: which queued rank is uploaded when, and what its outcome does.

Ranks are drained oldest first, ``KNOBS.ranks_at_once`` at a time. An attempt that fails with a
non-retryable error (access denied, missing bucket) records the error on the entry (``wait``
raises ``TierError`` naming it) and the rank is tried again every ``KNOBS.failed_retry_seconds``.
A rank that leaves the local tier before it is drained (evicted by capacity, or superseded by a
re-save that is not selected) fails for good: logged, counted, its partial upload deleted. A rank
whose step an operator deleted (``tierckpt rm``: the delete, or the removal of the local copies,
tells the drainer; or the uploader finds the step's tombstone, :mod:`.tombstone`) is cancelled:
not counted as a failure, ``wait`` says it was deleted. A drained rank leaves the durable queue,
its step is unpinned (once no rank of it is queued), and retention runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tierckpt.errors import DataLossError, PermissionDeniedError

from ..backends import BackendError
from ..config import DaemonConfig
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..local.store import Eviction, LocalStore
from ..offload import run_blocking
from .calls import Stopped
from .catalog import Catalog
from .ledger import Entry, Ledger
from .queue import QueueWriter
from .retention import Retention
from .selection import selected
from .tombstone import StepDeleted
from .uploader import RankUploader

__all__ = ["Drainer"]

log = logging.getLogger(__name__)


def _count_failure(metrics: Any, *, final: bool) -> None:
    """Count a failed drain attempt (``final``: the rank is given up)."""
    if metrics:
        metrics.drain_failures.inc()
        if final:
            metrics.saves.labels(tier="persistent", result="error").inc()


class Drainer:
    """Queues selected ranks and drains them (see the module docstring).

    Args:
        config: ``node_id``, ``persist_every``, ``keep_persistent``, ``persistent`` (the URL).
        store: the local store (ranks are pinned there while queued).
        ledger: the in-memory state of drains.
        queue: the durable queue, written off the loop.
        uploader: uploads one rank.
        catalog: told when this process changed a job's objects.
        retention: run after each drain when ``keep_persistent`` is set.
        metrics: optional metrics.
        spawn: starts a background task owned by the tier.
    """

    def __init__(self, config: DaemonConfig, store: LocalStore, ledger: Ledger, queue: QueueWriter,
                 uploader: RankUploader, catalog: Catalog, retention: Retention, metrics: Any,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task], *,
                 repair: Callable[[Manifest], Awaitable[bool]] | None = None) -> None:
        self.config = config
        self.url = config.persistent
        self.store = store
        self.ledger = ledger
        self.queue = queue
        self.uploader = uploader
        self.catalog = catalog
        self.retention = retention
        self.metrics = metrics
        self._spawn = spawn
        self._wake = asyncio.Event()
        self._stopping = False
        self.running: set[asyncio.Task] = set()
        self._forced: set[tuple[str, int]] = set()  # steps an operator asked to persist (PersistStep)
        self.repair = repair
        """Replaces a corrupt local copy with a verified one from elsewhere (the node's, through the tier)."""

    # ----------------------------------------------------------------------------- queueing

    def select(self, manifest: Manifest) -> None:
        """Queue ``manifest``'s rank if selected; an unselected re-save fails the queued one."""
        every = self.store.policies.persist_every(manifest.job, self.config.persist_every)
        if not selected(manifest, every) and not self.forced(manifest):
            e = self.ledger.pending.get(manifest.key)
            if e is not None:  # a re-save that is not selected supersedes the queued one
                self.fail(e, "superseded by a re-save that is not selected for the persistent tier")
            return
        self.enqueue(manifest, time.time(), durable=True)

    def forced(self, man: Manifest) -> bool:
        """Whether an operator asked for ``man``'s step (``tierckpt persist``) in this process."""
        return (man.job, man.step) in self._forced

    def force(self, man: Manifest) -> None:
        """Queue a rank that was not selected, like a selected one (``tierckpt persist``)."""
        self._forced.add((man.job, man.step))
        if man.key not in self.ledger.pending and self.ledger.recent.get(man.key) != man.generation:
            self.enqueue(man, time.time(), durable=True)

    def enqueue(self, man: Manifest, enqueued: float, *, durable: bool) -> None:
        """Queue (or re-queue, for a re-save) a rank, pin its step, wake the loop."""
        e = self.ledger.pending.get(man.key)
        if e is not None:
            e.man = man  # a re-save: the worker notices the new generation and drains it instead
            e.error, e.not_before = "", 0.0
        else:
            self.ledger.pending[man.key] = Entry(man, enqueued)
            if KNOBS.debug_drain_delay:
                self.ledger.pending[man.key].not_before = time.monotonic() + KNOBS.debug_drain_delay
        self.ledger.recent.pop(man.key, None)
        self.ledger.failed.pop(man.key, None)
        if durable:
            self.queue.put(man, enqueued)
        self.store.pin(man.job, man.step, "drain")
        if self.store.get(*man.key) is None:  # evicted between the commit and this call
            self.fail(self.ledger.pending[man.key], "evicted from the local tier before it was drained")
            return
        self.update_gauges()
        self._wake.set()

    def resume(self, docs: list[dict[str, Any]]) -> None:
        """Re-queue the durable queue's entries whose rank is still in the local store."""
        resumed = dropped = 0
        for doc in docs:
            job, step, rank = doc["job"], int(doc["step"]), int(doc["rank"])
            man = self.store.get(job, step, rank)
            if man is None:
                dropped += 1
                log.error("drain of %s step %d rank %d abandoned: the rank left the local tier before it was "
                          "drained (daemon restarted)", job, step, rank)
                self.ledger.failed[(job, step, rank)] = (doc.get("generation"),
                                                         "left the local tier before it was drained")
                _count_failure(self.metrics, final=True)
                self.queue.remove(job, step, rank)
                continue
            self.enqueue(man, doc["enqueued"], durable=False)
            resumed += 1
        log.info("persistent tier %s: %d pending drains resumed, %d abandoned", self.url, resumed, dropped)

    def on_evict(self, eviction: Eviction) -> None:
        """A queued rank evicted before its drain fails now (the store logged it loudly); one
        deleted on request (``tierckpt rm``) is cancelled."""
        for rank in eviction.ranks:
            e = self.ledger.pending.get((eviction.job, eviction.step, rank))
            if e is None:
                continue
            if eviction.reason == "deleted":
                self.cancel(e, "the step was deleted on request (tierckpt rm)")
            else:
                self.fail(e, f"evicted from the local tier before it was drained ({eviction.reason})")

    def cancel_step(self, job: str, step: int) -> tuple[set[str], list[asyncio.Task]]:
        """``tierckpt rm``: cancel every queued rank of the step. Returns the generations
        cancelled and the attempts still in flight (the caller waits them out)."""
        gens: set[str] = set()
        tasks: list[asyncio.Task] = []
        for key, e in list(self.ledger.pending.items()):
            if key[:2] == (job, step):
                gens.add(e.man.generation)
                if e.task is not None and not e.task.done():
                    tasks.append(e.task)
                self.cancel(e, "the step was deleted on request (tierckpt rm)")
        self._forced.discard((job, step))
        return gens, tasks

    def cancel(self, e: Entry, reason: str) -> None:
        """Stop draining a rank whose step was deleted: not a failure (``wait`` names ``reason``)."""
        self._drop(e, reason, failed=False)

    def fail(self, e: Entry, reason: str) -> None:
        """Give up on a queued rank for good (evicted or superseded): log, count, forget."""
        self._drop(e, reason, failed=True)

    def _drop(self, e: Entry, reason: str, *, failed: bool) -> None:
        """Forget a queued rank (``wait`` names ``reason``), unpin its step, delete its partial upload."""
        man = e.man
        if self.ledger.pending.get(man.key) is not e:
            return
        e.cancelled = True
        del self.ledger.pending[man.key]
        self.ledger.failed[man.key] = (man.generation, reason)
        self.queue.remove(*man.key)
        if failed:
            _count_failure(self.metrics, final=True)
        log.log(logging.ERROR if failed else logging.INFO, "drain of %s step %d rank %d to %s %s: %s", man.job,
                man.step, man.rank, self.url, "failed" if failed else "cancelled", reason)
        self.update_gauges()
        self.ledger.broadcast()
        self._spawn(self._unpin(man.job, man.step))
        self._spawn(self.uploader.forget_orphans(man))

    # ----------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Start attempts, oldest entries first, until :meth:`stop`."""
        while not self._stopping:
            self._wake.clear()
            now = time.monotonic()
            idle = sorted((e for e in self.ledger.pending.values() if not e.running),
                          key=lambda e: (e.enqueued, e.man.step, e.man.rank))
            for e in idle:
                if len(self.running) >= KNOBS.ranks_at_once:
                    break
                if e.not_before <= now:
                    e.running = True
                    task = e.task = asyncio.create_task(self._attempt(e))
                    self.running.add(task)
                    task.add_done_callback(self._attempt_done)
            delays = [e.not_before - now for e in self.ledger.pending.values()
                      if not e.running and e.not_before > now]
            try:
                await asyncio.wait_for(self._wake.wait(), min(delays) if delays else None)
            except TimeoutError:
                pass

    def _attempt_done(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        self._wake.set()

    async def stop(self, timeout: float) -> None:
        """Start no attempt any more; let in-flight ones finish within ``timeout`` (the tier
        cancels what is left; those ranks stay queued)."""
        self._stopping = True
        self._wake.set()
        if self.running:
            _, pending = await asyncio.wait(set(self.running), timeout=timeout)
            if pending:
                log.warning("shutdown: %d drains still uploading after %.0fs; they resume at the next start",
                            len(pending), timeout)

    async def _attempt(self, e: Entry) -> None:
        """One attempt at one rank; the outcome is recorded on the entry (task boundary)."""
        man = e.man
        try:
            uploaded = await self.uploader.upload(e, man)
        except Stopped:
            return
        except (BackendError, OSError) as err:
            self._attempt_failed(e, man, err)
            return
        except StepDeleted as err:  # the uploader saw the tombstone before cancel_step reached this rank
            self.cancel(e, f"the step was deleted on request (tierckpt rm): {err}")
            return
        except PermissionDeniedError as err:  # the job is another identity's in the store: never retried
            self.fail(e, str(err))
            return
        except DataLossError as err:  # the local copy is corrupt: nothing was published
            await self._local_copy_corrupt(e, man, err)
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # task boundary: a bug must not kill the drain loop silently
            log.exception("drain of %s step %d rank %d crashed; trying again later", man.job, man.step, man.rank)
            e.not_before = time.monotonic() + KNOBS.failed_retry_seconds
            return
        finally:
            e.running = False
        if uploaded and self.ledger.pending.get(man.key) is e and e.man.generation == man.generation:
            await self._finish(e)

    def _attempt_failed(self, e: Entry, man: Manifest, err: Exception) -> None:
        current = self.store.get(*man.key)
        if self.ledger.pending.get(man.key) is not e:
            return  # failed meanwhile (evicted): already reported
        if current is None:
            self.fail(e, f"left the local tier before it was drained ({err})")
        elif current.generation == man.generation:
            retry = KNOBS.failed_retry_seconds
            e.error = str(err) or type(err).__name__
            e.not_before = time.monotonic() + retry
            _count_failure(self.metrics, final=False)
            log.error("drain of %s step %d rank %d to %s failed: %s; trying again in %.0fs",
                      man.job, man.step, man.rank, self.url, e.error, retry)
            self.ledger.broadcast()
        # else: superseded by a re-save; the next attempt drains the new generation

    async def _local_copy_corrupt(self, e: Entry, man: Manifest, err: DataLossError) -> None:
        """The rank stays queued (wait("persistent") does not succeed); a verified peer copy
        replaces the local one when a peer holds it, and the drain is tried again at once."""
        if self.ledger.pending.get(man.key) is not e:
            return
        _count_failure(self.metrics, final=False)
        repaired = False
        if self.repair is not None:
            try:
                repaired = await self.repair(man)
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed repair is a refused drain, never a retry loop without a pause
                log.exception("drain of %s step %d rank %d: repairing the local copy crashed",
                              man.job, man.step, man.rank)
        if not repaired:
            e.error = f"local copy corrupt: {err}"
        if repaired:
            log.warning("drain of %s step %d rank %d: local copy replaced by a verified peer copy; draining again",
                        man.job, man.step, man.rank)
            e.not_before = time.monotonic()
        else:
            e.not_before = time.monotonic() + KNOBS.failed_retry_seconds
            log.error("drain of %s step %d rank %d to %s refused: %s; no good copy to drain from yet "
                      "(a re-save or a peer copy drains it); trying again in %.0fs",
                      man.job, man.step, man.rank, self.url, err, KNOBS.failed_retry_seconds)
        self.ledger.broadcast()

    async def _finish(self, e: Entry) -> None:
        man = e.man
        self.ledger.pending.pop(man.key, None)
        self.queue.remove(*man.key)  # ordered before any put of a re-save that follows
        self.ledger.recent[man.key] = man.generation
        self.catalog.note(man)
        self.catalog.invalidate(man.job)
        if self.metrics:
            self.metrics.saves.labels(tier="persistent", result="ok").inc()
            self.metrics.saved_bytes.labels(tier="persistent").inc(man.nbytes)
        log.info("drained %s step %d rank %d (%d bytes) to %s in %.1fs", man.job, man.step, man.rank, man.nbytes,
                 self.url, time.time() - e.enqueued)
        self.update_gauges()
        await self._unpin(man.job, man.step)  # before waiters return: retention has run when they look
        self.ledger.broadcast()
        if self.store.policies.keep_persistent(man.job, self.config.keep_persistent):
            self._spawn(self.retention.retain(man.job))

    async def _unpin(self, job: str, step: int) -> None:
        """Release the step's drain pin once none of its ranks is queued (the pin is per step)."""
        if self.ledger.has_pending(job, step):
            return
        await run_blocking(self.store.unpin, job, step, "drain")
        if self.ledger.has_pending(job, step):  # re-saved and queued meanwhile
            self.store.pin(job, step, "drain")

    # ----------------------------------------------------------------------------- figures

    def update_gauges(self) -> None:
        """Publish the backlog to the metrics."""
        if self.metrics:
            st = self.ledger.status(self.url)
            self.metrics.drain_backlog_bytes.set(st["backlog_bytes"])
            self.metrics.drain_oldest_age.set(st["oldest_age_seconds"])
