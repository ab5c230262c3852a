"""Restore (``fetch``): bring one rank from the object store into the local store, verified.

The rank's manifest is read, the shards are downloaded in parallel (content layout: each chunk,
decoded by the codec the manifest names, written at its offset; per-shard layout: each large
object in parallel ranges by its backend, through the codec its manifest names) into staging files of
the local store, and the local commit verifies every checksum; a copy that fails is discarded and
counted, never returned. The node pins the step around a restore.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import stat
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt.errors import DataLossError, NotFoundError, UnavailableError

from .. import fetchprogress
from ..backends import BackendError
from ..knobs import KNOBS
from ..local.manifest import Manifest, ShardEntry
from ..local.store import LocalStore
from ..offload import run_blocking, run_owning
from .calls import BackendCalls
from .catalog import Catalog, count_checksum_failure
from .codec import codec_named
from .content import ContentStore, settled
from .layout import data_key, is_content
from .ledger import Key

__all__ = ["Restorer"]


def _size_of(path: Path) -> int:
    """Size of a downloaded staging file, not following a link (-1 when it is not a regular file)."""
    st = os.lstat(path)
    return st.st_size if stat.S_ISREG(st.st_mode) else -1

log = logging.getLogger(__name__)


class Restorer:
    """Fetches ranks of the object store into the local store.

    Args:
        store: the local store.
        calls: the tier's object-store handle.
        catalog: reads the store's manifests and remembers what was restored.
        metrics: optional metrics (``checksum_failures``).
        announce: called with the local manifest of every rank committed by a fetch.
        content: reads shards stored in the content layout.
    """

    def __init__(self, store: LocalStore, calls: BackendCalls, catalog: Catalog, metrics: Any,
                 announce: Callable[[Manifest], None], content: ContentStore) -> None:
        self.content = content
        self.store = store
        self.calls = calls
        self.catalog = catalog
        self.metrics = metrics
        self.announce = announce
        self._locks: weakref.WeakValueDictionary[Key, asyncio.Lock] = weakref.WeakValueDictionary()
        self._pace = asyncio.Lock()

    async def fetch(self, job: str, step: int, rank: int, job_owner: str | None = None) -> Manifest:
        """Download one rank into the local store, verified, and return its local manifest.

        Raises:
            NotFoundError: the persistent tier has no manifest for the rank.
            DataLossError: the copy failed verification or misses a shard (logged, counted).
            UnavailableError: the store could not be read within the read retry policy.
            CapacityError: the local tier cannot hold the rank.
        """
        key = (job, step, rank)
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        async with lock:
            local = self.store.get(job, step, rank)
            if local is not None:  # a concurrent restore of the same rank brought it
                return local
            remote = await self.catalog.read_manifest(job, step, rank)
            if job_owner is not None and remote.job_owner != job_owner:
                raise NotFoundError(f"{job} step {step} rank {rank} in the persistent tier was saved by another owner")
            try:
                return await self._download(remote)
            except NotFoundError as err:  # a data object vanished: re-saved or deleted meanwhile?
                fresh = await self.catalog.read_manifest(job, step, rank)
                if fresh.generation == remote.generation:
                    raise self._missing_data(remote, err) from err
            try:
                return await self._download(fresh)
            except NotFoundError as err:
                raise self._missing_data(fresh, err) from err

    def _missing_data(self, man: Manifest, err: Exception) -> DataLossError:
        count_checksum_failure(self.metrics)
        log.error("persistent copy of %s step %d rank %d is missing data: %s", man.job, man.step, man.rank, err)
        return DataLossError(f"persistent copy of {man.job} step {man.step} rank {man.rank} is missing data: {err}")

    async def _download(self, remote: Manifest) -> Manifest:
        """Fetch one rank into the local store."""
        job, step, rank = remote.key
        big = next((s.name for s in remote.shards for c in s.chunks if c[1] > KNOBS.chunk_bytes), None)
        if big is not None:  # refused before a staging file of its size is made, or any chunk is read
            count_checksum_failure(self.metrics)
            log.error("persistent copy of %s step %d rank %d names a chunk over %d bytes (shard %r), refused",
                      job, step, rank, KNOBS.chunk_bytes, big)
            raise DataLossError(f"persistent copy of {job} step {step} rank {rank}: shard {big!r} has a chunk of "
                                f"more than the chunk size ({KNOBS.chunk_bytes} bytes)")
        fetchprogress.started(remote.nbytes, self.catalog.url)
        specs = [(s.name, s.size, s.dtype, s.shape) for s in remote.shards]
        st = await run_owning(self.store.begin, self.store.abort_staging, job, step, rank, remote.world_size, specs,
                              stream=False, prefault=True, job_owner=remote.job_owner)
        try:
            await settled(*(self._get_shard(st, remote, s, st.files[s.name].path) for s in remote.shards))
            local, _ = await run_blocking(
                self.store.commit, st.save_id, {s.name: s.checksum for s in remote.shards},
                remote.metadata_json, persist=remote.persist, verify=True, node=remote.node,
                generation=remote.generation, created=remote.created)
        except DataLossError as err:  # the commit verified the bytes and aborted, or a codec failed
            count_checksum_failure(self.metrics)
            log.error("persistent copy of %s step %d rank %d failed verification, discarded: %s",
                      job, step, rank, err)
            await run_blocking(self.store.abort, st.save_id)
            raise DataLossError(f"persistent copy in {self.catalog.url} failed verification: {err}") from err
        except BaseException:
            await run_blocking(self.store.abort, st.save_id)
            raise
        self.catalog.note(local)
        log.info("restored %s step %d rank %d (%d bytes) from %s", job, step, rank, local.nbytes, self.catalog.url)
        self.announce(local)
        return local

    async def _get_shard(self, st: Any, remote: Manifest, shard: ShardEntry, path: Path) -> None:
        try:
            if is_content(shard):
                key = f"the chunks of {shard.name!r}"
                await self.content.get_shard(remote.job, shard, path)
            else:
                be, key, codec = self.calls.be, data_key(*remote.key, shard), codec_named(shard.codec)
                await self.calls.read(functools.partial(codec.download_into, functools.partial(be.get_file, key),
                                                        path))
        except BackendError as err:
            raise UnavailableError(f"persistent tier {self.catalog.url}: {err}") from err
        got = await run_blocking(_size_of, path)
        if got != shard.size:  # the object disagrees with its manifest: never hashed through a short map
            raise DataLossError(f"object {key} has {got} bytes, its manifest says {shard.size}")
        st.created = time.monotonic()  # progress: keep the staging reaper away from a long restore
        if KNOBS.fetch_pace:  # tests: a fetch slow enough to watch (the shards land one by one)
            async with self._pace:
                await asyncio.sleep(KNOBS.fetch_pace)
        fetchprogress.advanced(shard.size)
