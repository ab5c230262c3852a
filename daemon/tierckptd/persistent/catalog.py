"""What the persistent tier holds: the per-job catalog cache and manifest reads.

A job's catalog is one listing of its manifests (:mod:`.layout`), cached for
``KNOBS.catalog_ttl`` seconds and dropped as soon as this process changed the job's objects (a
drain, a deletion: the job's epoch moves). At most one listing per job is in flight; a caller
waits for it up to ``KNOBS.catalog_wait`` seconds, then answers from the previous listing, so a
slow or unreachable object store never holds ``latest()`` up for long while the local and peer
tiers can answer.

A listing gives step, rank and world size (the manifest key); the size and age of a rank come
from its manifest. Those this process drained or restored are remembered; after a listing, up
to ``SIZE_READS`` others, newest steps first, are read (``KNOBS.read_threads`` at once) within
what is left of ``catalog_wait``, so ``tierckpt ls`` shows the bytes of steps held only in the
object store after a restart; a job with more unread manifests fills in over later listings.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from tierckpt.errors import DataLossError, NotFoundError, UnavailableError

from ..backends import BackendError
from ..knobs import KNOBS
from ..local.manifest import Manifest
from ..retry import RetryPolicy
from ..tiers import RankCopy
from .calls import BackendCalls
from .layout import (
    data_key,
    is_content,
    job_manifests_prefix,
    manifest_rank_prefix,
    parse_manifest_key,
    parse_tombstone_key,
)
from .ledger import Bounded, Key
from .tombstone import read_tombstone

__all__ = ["Catalog", "count_checksum_failure", "SIZE_READS"]

SIZE_READS = 512
"""Manifests of unknown size read after one listing of a job (one GET each)."""

log = logging.getLogger(__name__)

Steps = dict[int, dict[int, int]]
"""step -> rank -> world size"""


def count_checksum_failure(metrics: Any) -> None:
    """Count a persistent copy that failed verification (or is corrupt or incomplete)."""
    if metrics:
        metrics.checksum_failures.labels(tier="persistent").inc()


class Catalog:
    """The job catalogs of the object store, and the manifests of its ranks.

    Args:
        calls: the tier's object-store handle.
        url: the store's URL (messages).
        metrics: optional metrics (corrupt manifests are counted as checksum failures).
        spawn: starts a background task owned by the tier.
    """

    def __init__(self, calls: BackendCalls, url: str, metrics: Any,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task]) -> None:
        self.calls = calls
        self.url = url
        self.metrics = metrics
        self._spawn = spawn
        self.known: Bounded = Bounded(65536)  # key -> (nbytes, created, job_owner) of manifests seen here
        # job -> (listed at, epoch, step -> rank -> world or None, error); stale once the epoch moved
        self._cache: dict[str, tuple[float, int, Steps | None, str]] = {}
        self._epochs: dict[str, int] = collections.defaultdict(int)
        self._listings: dict[str, tuple[int, asyncio.Task]] = {}  # job -> (epoch, listing in flight)
        self._keys: Bounded = Bounded(65536)  # (job, step, rank) -> its manifest's object key, as listed
        self._sizing: dict[str, asyncio.Task] = {}  # job -> manifest reads for sizes in flight

    def invalidate(self, job: str) -> None:
        """This process changed the job's objects: the next catalog lists again."""
        self._epochs[job] += 1

    def note(self, man: Manifest) -> None:
        """Remember the size, age and owner of a rank this process drained, restored or read."""
        self.known[man.key] = (man.nbytes, man.created, man.job_owner)

    def forget_step(self, job: str, step: int) -> None:
        """The step was deleted from the store."""
        for k in [k for k in self.known if k[0] == job and k[1] == step]:
            del self.known[k]

    async def list_steps(self, job: str, policy: RetryPolicy | None = None, *, checked: bool = True) -> Steps:
        """step -> rank -> world size from one listing of the job's manifests; with ``checked`` only
        the ranks whose manifest passes its checks (MAC, fields), read once each: a step counts
        only once its owner is known (``verify`` lists all)."""
        keys = await self.calls.read(functools.partial(self.calls.be.list, job_manifests_prefix(job)), policy)
        out: Steps = {}
        deleted: set[int] = set()
        objects: dict[tuple[int, int], str] = {}
        for key in keys:
            parsed = parse_manifest_key(job, key)
            if parsed is None:
                if (tomb := parse_tombstone_key(job, key)) is not None:
                    deleted.add(tomb)
                continue
            step, rank, world = parsed
            if rank not in out.setdefault(step, {}):  # two worlds for a rank: a re-save mid-cleanup
                out[step][rank] = world
                objects[(step, rank)] = key
            self._keys[(job, step, rank)] = key
        for step in deleted & out.keys():  # rare: a save after `rm`, or a drain that raced it
            await self._drop_deleted(job, step, out)
        if checked:
            await self._drop_unverified(job, out, objects, policy)
        return out

    async def _drop_unverified(self, job: str, out: Steps, objects: dict[tuple[int, int], str],
                               policy: RetryPolicy | None) -> None:
        """Read and check (MAC, fields) each listed manifest this process has not seen yet, and
        drop the ranks whose manifest fails: a manifest forged in the bucket never makes a step
        complete. One GET per new manifest, ``KNOBS.fanout`` at a time; the ranks seen are
        remembered in :attr:`known` (with their size, which ``ls`` shows)."""
        todo = [(step, rank) for step, ranks in out.items() for rank in ranks if (job, step, rank) not in self.known]
        sem = asyncio.Semaphore(max(1, KNOBS.fanout))

        async def check(step: int, rank: int) -> None:
            key = objects.get((step, rank))
            if key is None:  # not from this listing: unchecked, so not counted
                out[step].pop(rank, None)
                return
            async with sem:
                try:
                    data = await self.calls.read(functools.partial(self.calls.be.get_bytes, key), policy)
                    self.note(self._check_manifest(key, data, (job, step, rank), out[step][rank]))
                except NotFoundError:  # deleted since the listing
                    out[step].pop(rank, None)
                except DataLossError:  # logged and counted by _check_manifest
                    out[step].pop(rank, None)

        await asyncio.gather(*(check(step, rank) for step, rank in todo))
        for step in [s for s, ranks in out.items() if not ranks]:
            del out[step]

    async def _drop_deleted(self, job: str, step: int, out: Steps) -> None:
        """Drop the ranks of ``step`` whose manifest its tombstone covers (:mod:`.tombstone`)."""
        for rank in list(out[step]):
            try:
                await self.read_manifest(job, step, rank)
            except NotFoundError:  # covered (or deleted meanwhile)
                del out[step][rank]
            except DataLossError:
                pass  # a restore reports it
        if not out[step]:
            del out[step]

    async def catalog(self, job: str) -> dict[int, dict[int, RankCopy]]:
        """The ranks of ``job`` with a manifest in the store (see the module docstring).

        Raises:
            UnavailableError: no listing has succeeded yet (failed or still running).
        """
        return (await self.catalog_with_gaps(job))[0]

    async def catalog_with_gaps(self, job: str) -> tuple[dict[int, dict[int, RankCopy]], list[str]]:
        """:meth:`catalog`, and the store named as unreachable when the answer comes from an
        earlier listing (the current one failed, or did not finish within ``catalog_wait``)."""
        stale = False
        epoch = self._epochs[job]
        cached = self._cache.get(job)
        if cached is None or cached[1] != epoch or time.monotonic() - cached[0] > KNOBS.catalog_ttl:
            inflight = self._listings.get(job)
            if inflight is None or inflight[0] != epoch:
                inflight = self._listings[job] = (epoch, self._spawn(self._refresh(job, epoch)))
            until = time.monotonic() + KNOBS.catalog_wait
            try:
                await asyncio.wait_for(asyncio.shield(inflight[1]), KNOBS.catalog_wait)
            except TimeoutError:
                log.warning("persistent catalog of %s: listing %s takes longer than %.0fs; answering without it",
                            job, self.url, KNOBS.catalog_wait)
                stale = True
            sizing = self._sizing.get(job)
            if sizing is not None and not stale:  # sizes of ranks not seen before: what arrives in time
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(sizing), max(0.0, until - time.monotonic()))
            cached = self._cache.get(job)
        if cached is None:
            raise UnavailableError(f"persistent tier {self.url}: cannot list {job} yet")
        listed, _, steps, error = cached
        if steps is None:
            raise UnavailableError(f"persistent tier {self.url}: cannot list {job}: {error}")
        gaps = []
        if stale or error:
            gaps.append(f"persistent tier {self.url} (answered from a listing {time.monotonic() - listed:.0f}s old: "
                        f"{error or 'the store did not answer in time'})")
        out: dict[int, dict[int, RankCopy]] = {}
        for step, ranks in steps.items():
            for rank, world in ranks.items():
                nbytes, created, owner = self.known.get((job, step, rank), (0, 0.0, ""))
                out.setdefault(step, {})[rank] = RankCopy(world, (), nbytes, created, owner)
        return out, gaps

    async def _refresh(self, job: str, epoch: int) -> None:
        """List the job's manifests into the cache (a task: errors are recorded, not raised)."""
        entry: tuple[float, int, dict[int, dict[int, int]] | None, str]
        try:
            entry = (time.monotonic(), epoch, await self.list_steps(job, KNOBS.catalog_retry), "")
        except (BackendError, UnavailableError) as err:
            previous = self._cache.get(job)
            stale = previous[2] if previous else None
            entry = (time.monotonic(), epoch, stale, str(err))
            log.warning("persistent catalog of %s: listing %s failed: %s%s", job, self.url, err,
                        "; using the previous listing" if stale is not None else "")
        finally:
            if self._listings.get(job, (None,))[0] == epoch:
                del self._listings[job]
        current = self._cache.get(job)
        if current is None or current[1] <= epoch:  # a newer listing may have finished first
            self._cache[job] = entry
        unknown = sorted((k for k in self._keys if k[0] == job and k not in self.known and entry[2] is not None
                          and k[2] in entry[2].get(k[1], {})), key=lambda k: -k[1])[:SIZE_READS]
        if unknown and job not in self._sizing:
            task = self._sizing[job] = self._spawn(self._read_sizes(unknown))
            task.add_done_callback(lambda _t: self._sizing.pop(job, None))

    async def _read_sizes(self, keys: list[Key]) -> None:
        """Remember the size and age of listed ranks from their manifests (a task; errors skip a rank)."""
        gate = asyncio.Semaphore(KNOBS.read_threads)

        async def one(k: Key) -> None:
            obj = self._keys.get(k)
            if obj is None:
                return
            async with gate:
                try:
                    data = await self.calls.read(functools.partial(self.calls.be.get_bytes, obj))
                    man = Manifest.from_json(data)
                except (BackendError, NotFoundError, UnavailableError, DataLossError, ValueError) as err:
                    log.debug("persistent catalog: size of %s unknown: %s", obj, err)
                    return
            if man.key == k:
                self.note(man)

        await asyncio.gather(*(one(k) for k in keys))

    async def read_manifest(self, job: str, step: int, rank: int) -> Manifest:
        """The rank's manifest in the store (the newest, if a re-save is being cleaned up).

        Raises:
            NotFoundError: there is none.
            DataLossError: it is malformed or names another rank (counted).
            UnavailableError: the store cannot be read.
        """
        be = self.calls.be
        try:
            keys = await self.calls.read(functools.partial(be.list, manifest_rank_prefix(job, step, rank)))
            found: list[Manifest] = []
            for key in keys:
                parsed = parse_manifest_key(job, key)
                if parsed is None:
                    continue
                try:
                    data = await self.calls.read(functools.partial(be.get_bytes, key))
                except NotFoundError:
                    continue  # deleted meanwhile
                found.append(self._check_manifest(key, data, (job, step, rank), parsed[2]))
        except BackendError as err:
            raise UnavailableError(f"persistent tier {self.url}: {err}") from err
        if not found:
            raise NotFoundError(f"{job} step {step} rank {rank} is not in the persistent tier {self.url}")
        newest = max(found, key=lambda m: m.created)
        try:
            stone = await read_tombstone(self.calls, job, step)
        except BackendError as err:
            raise UnavailableError(f"persistent tier {self.url}: {err}") from err
        if stone is not None and stone.covers(newest):
            raise NotFoundError(f"{job} step {step} rank {rank} was deleted from the persistent tier {self.url} "
                                f"(by {stone.by or 'an operator'})")
        return newest

    def _check_manifest(self, key: str, data: bytes, want: Key, world: int) -> Manifest:
        try:
            man = Manifest.from_json(data)
            if man.key != want or man.world_size != world:
                raise DataLossError(f"it describes {man.job} step {man.step} rank {man.rank}/{man.world_size}")
            for s in man.shards:
                if not is_content(s):
                    data_key(*want, s)
        except DataLossError as err:
            count_checksum_failure(self.metrics)
            log.error("persistent tier: manifest %s%s is corrupt: %s", self.url, key, err)
            raise DataLossError(f"persistent manifest {key} is corrupt: {err}") from err
        return man
