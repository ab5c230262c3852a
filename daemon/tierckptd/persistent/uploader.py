"""Draining one rank: its shards first, its manifest last, then cleanup.

A rank's upload reads its shards from the local store while the rank stays committed there
(the step is pinned while queued) and stores them in the content layout (chunks named by hash,
compressed, deduplicated: :mod:`.content`), or, for a tier built with a per-shard
:class:`~.codec.ShardCodec`, puts each as ``<job>/data/<step>/rank-<rank>/<file>`` unless an
earlier attempt already stored that object (object names are per generation); it then checks that
the rank is still the same save, uploads the manifest, and deletes what older saves of the rank
left (other manifests first, then data no manifest names).

A copy of another owner's rank (a take-over, see :mod:`.takeover`) is uploaded in its owner's
form: data objects named ``<shard>.<generation>`` (the owner's save id) and the owner's manifest
unchanged, so a recovering owner and a taking-over holder write the same objects and manifest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from typing import Any, BinaryIO, cast

from tierckpt.common.names import check_shard
from tierckpt.errors import DataLossError, InvalidArgumentError, NotFoundError, UnavailableError

from ..backends import BackendError
from ..knobs import KNOBS
from ..local.index import check_job_owner
from ..local.manifest import Manifest
from ..local.store import LocalStore
from .calls import BackendCalls, Stopped
from .catalog import Catalog
from .codec import IDENTITY, ShardCodec
from .content import ContentStore
from .layout import data_key, is_content, manifest_key, manifest_rank_prefix, rank_data_prefix
from .ledger import Bounded, Entry
from .tombstone import StepDeleted, read_tombstone
from .verify import VerifyingReader

__all__ = ["RankUploader"]

log = logging.getLogger(__name__)

_VERIFY_CHUNK = 16 << 20


class RankUploader:
    """Uploads committed ranks of the local store.

    Args:
        store: the local store.
        calls: the tier's object-store handle.
        catalog: reads the store's manifests (take-overs compare with them).
        node_id: this node (a rank owned elsewhere is uploaded in its owner's form).
        metrics: optional metrics (``drained_bytes``).
        codec: the codec new shards are stored with in the per-shard layout (default: the identity).
        content: stores new shards in the content layout instead (the daemon's way).
    """

    def __init__(self, store: LocalStore, calls: BackendCalls, catalog: Catalog, node_id: str,
                 metrics: Any = None, codec: ShardCodec = IDENTITY, content: ContentStore | None = None) -> None:
        self.content = content
        self.store = store
        self.calls = calls
        self.catalog = catalog
        self.node_id = node_id
        self.metrics = metrics
        self.codec = codec
        self._owner_checked: Bounded = Bounded(4096)  # (job, job owner) found to own the job in the store

    async def upload(self, e: Entry, man: Manifest) -> bool:
        """Upload a rank's shards, then its manifest. Returns False if a re-save superseded it.

        Raises:
            Stopped: the tier stopped or the entry was cancelled while retrying.
            BackendError: a non-retryable store error.
            DataLossError: a local shard does not match its checksum (counted; nothing of it is
                published, and the manifest is not uploaded).
            StepDeleted: ``tierckpt rm`` deleted the step after this save; nothing is published.
            OSError: a local file cannot be read, or the rank left the local tier.
        """
        job, step, rank = man.key
        held = self.store.get(job, step, rank)  # read through the copy held now (a repair may have
        if held is None:                        # replaced the files of the same save)
            raise FileNotFoundError(f"{job} step {step} rank {rank} is no longer in the local tier")
        if held.generation != man.generation:
            return False
        await self._check_job_owner(man)
        local, man = man, self.stored_form(man)
        if self.content is None:
            await asyncio.gather(*(self._put_shard(e, data_key(job, step, rank, s), held, s.name)
                                   for s in man.shards))
            return await self._publish(e, local, man)
        try:
            man, lease, leased = await self.content.put_rank(held, man, lambda: e.cancelled)
        except DataLossError as err:
            log.error("drain of %s step %d rank %d refused: %s", job, step, rank, err)
            if self.metrics:
                self.metrics.checksum_failures.labels(tier="local").inc()
            raise
        try:
            return await self._publish(e, local, man, leased)
        finally:  # published or not, the lease's work is over (a manifest protects its chunks)
            await self.content.release(lease)

    async def _publish(self, e: Entry, local: Manifest, man: Manifest, leased: float | None = None) -> bool:
        """Upload the manifest once the rank is known to be the same save; False if superseded."""
        job, step, rank = man.key
        # Every byte above was read while the rank was still committed here (eviction removes it
        # from the catalog before touching its files), unless this check fails.
        current = self.store.get(job, step, rank)
        if current is None:
            raise FileNotFoundError(f"{job} step {step} rank {rank} is no longer in the local tier")
        if current.generation != man.generation:
            return False
        if KNOBS.debug_manifest_delay:  # test hook: every shard is up, the manifest is not
            await asyncio.sleep(KNOBS.debug_manifest_delay)
        if self.owner_form(local) is not local and await self._newer_in_store(man):
            log.info("take-over of %s step %d rank %d: a newer save of it is in %s; not replacing it",
                     job, step, rank, self.catalog.url)
            return True
        if leased is not None:
            ContentStore.check_lease(leased)
        await self._check_not_deleted(e, man)
        key = manifest_key(job, step, rank, man.world_size)
        await self.calls.write(functools.partial(self.calls.be.put_bytes, key, man.to_json()), lambda: e.cancelled)
        try:
            await self._check_not_deleted(e, man, ignore_cancel=True)
        except StepDeleted:  # deleted while the manifest was on its way: take it back
            await self.calls.write(functools.partial(self.calls.be.delete, [key]))
            self.catalog.invalidate(job)
            raise
        await self._remove_stale(e, man)
        return True

    async def _check_job_owner(self, man: Manifest) -> None:
        """PermissionDeniedError when the store holds the job for another identity: the job is its
        first saver's in the object store too, and a step of the same number never overwrites it.
        One listing per job and owner in this process (the catalog's): a job's owner does not change."""
        if (man.job, man.job_owner) in self._owner_checked:
            return
        try:  # a listing of its own, awaited whole (the catalog's answer gives up after catalog_wait)
            steps = await self.catalog.list_steps(man.job, KNOBS.catalog_retry)
        except UnavailableError as err:  # the listing failed: retried like a failed upload
            raise BackendError(str(err), retryable=True) from err
        owners = {self.catalog.known.get((man.job, step, rank), (0, 0.0, ""))[2]
                  for step, ranks in steps.items() for rank in ranks}
        check_job_owner(man.job, owners, man.job_owner, f"drain to {self.catalog.url}")
        self._owner_checked[(man.job, man.job_owner)] = True

    async def _check_not_deleted(self, e: Entry, man: Manifest, *, ignore_cancel: bool = False) -> None:
        """Raises StepDeleted if ``tierckpt rm`` deleted the step after this save (:mod:`.tombstone`)."""
        if e.cancelled and not ignore_cancel:
            raise Stopped()
        stone = await read_tombstone(self.calls, man.job, man.step)
        if stone is not None and stone.covers(man):
            raise StepDeleted(f"{man.job} step {man.step} was deleted (by {stone.by or 'an operator'}) after "
                              f"rank {man.rank} was saved; its manifest is not published")

    def stored_form(self, man: Manifest) -> Manifest:
        """The manifest as uploaded: the owner's form (:meth:`owner_form`), each shard naming the
        codec when it is not the identity."""
        man = self.owner_form(man)
        if self.codec is IDENTITY or self.content is not None:
            return man
        shards = tuple(dataclasses.replace(s, codec=self.codec.name) for s in man.shards)
        return dataclasses.replace(man, shards=shards)

    def owner_form(self, man: Manifest) -> Manifest:
        """A copy of another owner's rank as its owner uploads it: data files named ``<shard>.<generation>``
        (the owner's save id), so a take-over and the owner write the same objects and manifest."""
        if man.node == self.node_id:
            return man
        try:
            shards = tuple(dataclasses.replace(s, file=check_shard(f"{s.name}.{man.generation}"))
                           for s in man.shards)
        except InvalidArgumentError:  # an odd generation from a peer: keep this copy's own names
            return man
        return dataclasses.replace(man, shards=shards)

    async def _newer_in_store(self, man: Manifest) -> bool:
        """Whether the store holds another, newer save of the rank (a recovered owner's)."""
        try:
            remote = await self.catalog.read_manifest(*man.key)
        except (NotFoundError, DataLossError, UnavailableError):
            return False
        return remote.generation != man.generation and remote.created > man.created

    async def _put_shard(self, e: Entry, key: str, held: Manifest, shard: str) -> None:
        """Upload one shard, hashing every byte sent; a mismatch publishes nothing (DataLossError)."""
        be, codec, store, entry = self.calls.be, self.codec, self.store, held.shard(shard)
        what = f"{held.job} step {held.step} rank {held.rank} shard {shard!r}"

        def put() -> int:
            if be.exists(key):  # uploaded (and verified) before a restart: object names are per generation
                return 0
            try:
                fd = store.open_shard(held, shard)  # no link followed; a regular file of its size
            except NotFoundError as err:  # evicted or re-saved meanwhile: the rank left the local tier
                raise FileNotFoundError(str(err)) from err
            try:
                src = VerifyingReader(fd, entry.size, entry.checksum, what)
                if codec is IDENTITY:
                    be.put_stream(key, cast(BinaryIO, src), entry.size)
                else:  # a transform reads the file by path: verify the bytes it reads first
                    while src.read(_VERIFY_CHUNK):
                        pass
                    with codec.encoded(store.shard_path(held, shard)) as path:
                        be.put_file(key, path)
                src.check()
            except DataLossError:
                be.delete([key])  # a backend that sent everything before the last read (belt and braces)
                raise
            finally:
                os.close(fd)
            return entry.size

        try:
            sent = await self.calls.write(put, lambda: e.cancelled)
        except DataLossError as err:
            log.error("drain of %s refused: %s", what, err)
            if self.metrics:
                self.metrics.checksum_failures.labels(tier="local").inc()
            raise
        if sent and self.metrics:
            self.metrics.drained_bytes.inc(sent)

    async def _remove_stale(self, e: Entry, man: Manifest) -> None:
        """Delete what older saves of this rank left: other manifests first, then unnamed data."""
        job, step, rank = man.key
        be, cancelled = self.calls.be, (lambda: e.cancelled)
        keep_manifest = manifest_key(job, step, rank, man.world_size)
        manifests = await self.calls.write(functools.partial(be.list, manifest_rank_prefix(job, step, rank)),
                                           cancelled)
        stale = [k for k in manifests if k != keep_manifest]
        if stale:
            await self.calls.write(functools.partial(be.delete, stale), cancelled)
        keep = {data_key(job, step, rank, s) for s in man.shards if not is_content(s)}
        data = await self.calls.write(functools.partial(be.list, rank_data_prefix(job, step, rank)), cancelled)
        stale = [k for k in data if k not in keep]
        if stale:
            await self.calls.write(functools.partial(be.delete, stale), cancelled)

    async def forget_orphans(self, man: Manifest) -> None:
        """Best effort: delete data objects uploaded for a rank whose drain was abandoned.

        Nothing is deleted if the rank's manifest in the store names this very save (it was
        drained before a restart re-queued it), or if that cannot be checked.
        """
        keys = [data_key(man.job, man.step, man.rank, s) for s in man.shards if s.file]  # chunks: see .gc
        try:
            try:
                if (await self.catalog.read_manifest(*man.key)).generation == man.generation:
                    return
            except NotFoundError:
                pass
            await self.calls.read(functools.partial(self.calls.be.delete, keys), KNOBS.catalog_retry)
        except (BackendError, UnavailableError, DataLossError) as err:
            log.warning("could not delete the partial upload of %s step %d rank %d: %s",
                        man.job, man.step, man.rank, err)
