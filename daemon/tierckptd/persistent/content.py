"""Storing and fetching ranks in the content layout (:mod:`.layout`): chunks by hash, deduplicated.

Upload of one rank (:meth:`ContentStore.put_rank`), in this order:

1. Hash: every shard is read once from the local store through a
   :class:`~.verify.VerifyingReader` (the whole shard must match its checksum, or nothing is
   published) and every chunk's xxh3-128 is taken: the chunk keys are now known.
2. Lease: ``<job>/leases/<ms>-<token>.json`` listing those keys is stored.
3. Collections: while a collection marker ``<job>/gc/...`` exists, wait (see :mod:`.gc`).
4. Chunks (of all shards at once, ``KNOBS.upload_threads`` at a time): each chunk whose key
   exists is skipped (deduplicated) unless a restore of this process found it damaged (it is then
   stored again, which repairs every step naming it); the others are read again, checked against
   their hash (so every byte sent was verified), encoded and stored. Whether a chunk exists is
   asked (one request each) for the chunks the last drain of the same rank by this process also
   had, and for every chunk when this process has drained no such rank yet (after a restart); a
   chunk that drain did not have is new content and is stored without asking (at worst an
   identical object is written again), so a step where everything changed costs no extra request
   per chunk.
5. The caller publishes the manifest (commit marker), then :meth:`release` deletes the lease (a
   failed attempt deletes it too; one left by a killed process expires after ``KNOBS.lease_ttl``).

Download (:meth:`ContentStore.get_shard`): every chunk is checked before it is written: it must
decode under its codec (each codec rejects a truncated, extended or garbled body) to bytes that
hash to its name, so a damaged, truncated or swapped chunk is a :class:`DataLossError` naming
it (the restore's commit then verifies each shard's checksum again). The stored size a manifest
records is informational: a chunk stored again (repaired, or by another version of a codec
library) may differ in its encoding, never in its decoded bytes.

Why it is safe against a concurrent collection: a collection stores its marker, then reads the
leases and manifests, deletes, and removes its marker. If the drain saw no marker (3), any
collection that marks later reads this lease (2 came before 3), so it deletes none of these
chunks; if it saw one, it waited for that collection to finish before checking existence (4),
so a chunk that collection deleted is stored again. A marker counts for at most twice
``KNOBS.gc_window`` from when this process first saw it (the collection deletes nothing later
than ``gc_window`` after storing it); one that names this node and is not held by a collection
of this process (:attr:`ContentStore.collecting`) was left by a killed process, or by a
collection that could not delete it (the store was down), and is removed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import secrets
import time
from typing import Any

import xxhash
from tierckpt.errors import DataLossError, UnavailableError

from ..backends import BackendError, ObjectTooLargeError
from ..knobs import KNOBS
from ..local.localfs import open_checked
from ..local.manifest import Manifest, ShardEntry
from ..local.store import LocalStore
from .calls import BackendCalls
from .chunkread import ChunkReader
from .layout import (
    content_key,
    damaged_chunk,
    damaged_key,
    damaged_prefix,
    gc_prefix,
    job_manifests_prefix,
    lease_prefix,
    object_keys,
    parse_manifest_key,
    stamped_key,
)
from .ledger import Bounded

__all__ = ["ContentStore"]

log = logging.getLogger(__name__)

Chunk = tuple[str, int, int]


def _codec_for(setting: str, dtype: str) -> str:
    from .compress import choose

    return choose(setting, dtype)


class ContentStore:
    """Chunks of the content layout: upload with deduplication, download with decoding.

    Args:
        store: the local store.
        calls: the tier's object-store handle.
        setting: the ``codec`` setting (see :data:`.compress.SETTINGS`).
        metrics: optional metrics (``drained_bytes`` counts stored bytes sent).
        node_id: this node (its collection markers that no collection of this process holds,
            left by a killed process or a collection that could not remove its own, are removed).
    """

    def __init__(self, store: LocalStore, calls: BackendCalls, setting: str, metrics: Any = None,
                 node_id: str = "") -> None:
        self.store = store
        self.calls = calls
        self.setting = setting
        self.metrics = metrics
        self.node_id = node_id
        self.collecting: set[str] = set()  # markers of this process's collections in flight (see .gc)
        self.stored: Bounded = Bounded(1 << 20)  # chunk key -> stored size, of chunks seen by this process
        self.damaged: Bounded = Bounded(65536)  # chunk key -> True: a restore found it damaged (stored again)
        self.markers_seen: Bounded = Bounded(4096)  # collection marker -> when this process first saw it
        self.previous: Bounded = Bounded(256)  # (job, rank) -> chunk keys of its last drain by this process
        self.sent = 0  # stored bytes uploaded by this process (benchmarks)
        self._putting = 0  # put_rank calls in flight (the buffers are unmapped when none is)
        self.reader = ChunkReader(store, calls.halt)  # reads, checks and encodes chunks (threads or children)
        if hasattr(calls.be, "pace") and KNOBS.drain_yield > 0:  # a file store writes a chunk out piece by
            calls.be.pace = self.reader.yield_to_saves  # piece, waiting for saves between them (drain_yield)

    # ----------------------------------------------------------------------------- upload

    async def put_rank(self, held: Manifest, man: Manifest, cancelled: Any) -> tuple[Manifest, str, float]:
        """Steps 1-4 of the module docstring for the rank ``held`` (the local copy) in its stored
        form ``man``. Returns the manifest to publish, the lease key and when it was stored.

        Raises:
            DataLossError: a local shard does not match its checksum (nothing is published).
            Stopped, BackendError, OSError: as :meth:`RankUploader.upload`.
        """
        self._putting += 1
        try:
            return await self._put_rank(held, man, cancelled)
        finally:
            self._putting -= 1
            if not self._putting:
                self.reader.buffers.trim()

    async def _put_rank(self, held: Manifest, man: Manifest, cancelled: Any) -> tuple[Manifest, str, float]:
        job = man.job
        codecs = {s.name: _codec_for(self.setting, s.dtype) for s in man.shards}
        hashed = await asyncio.gather(*(self._hashed(held, s.name) for s in man.shards))
        plan = dict(zip((s.name for s in man.shards), hashed))
        keys = sorted({content_key(job, d, n, codecs[name]) for name, chunks in plan.items() for d, n in chunks})
        lease = stamped_key(lease_prefix(job), time.time(), secrets.token_hex(6), ".json")
        leased = time.monotonic()
        body = json.dumps({"created": time.time(), "keys": keys}).encode()
        await self.calls.write(functools.partial(self.calls.be.put_bytes, lease, body), cancelled)
        try:
            await self._wait_for_collections(job, cancelled)
            await self._note_damaged(job, cancelled)
            shards = await self._put_chunks(held, man, plan, codecs, cancelled)
        except BaseException:
            await asyncio.shield(self.release(lease))  # this attempt is over; the next one leases again
            raise
        return dataclasses.replace(man, shards=shards), lease, leased

    async def _put_chunks(self, held: Manifest, man: Manifest, plan: dict[str, list[tuple[str, int]]],
                          codecs: dict[str, str], cancelled: Any) -> tuple[ShardEntry, ...]:
        """Every chunk of every shard at once (``KNOBS.codec_threads`` read and encoded,
        ``KNOBS.upload_threads`` uploaded at a time: a rank of many one-chunk shards would otherwise
        go up one shard after the other); the manifest entries."""
        job = held.job
        work = [(s.name, off, d, n) for s in man.shards for (d, n), off in zip(plan[s.name], _offsets(plan[s.name]))]
        previous = self.previous.get((job, man.rank))
        if previous is None:  # this process has not drained the rank yet (a restart, a new node)
            previous = await self._stored_previous(job, man.step, man.rank)
        keys = [content_key(job, d, n, codecs[name]) for name, _, d, n in work]
        stored = await asyncio.gather(*(
            self._put_chunk(held, name, off, d, n, codecs[name], previous is None or key in previous, cancelled)
            for (name, off, d, n), key in zip(work, keys)))
        self.previous[(job, man.rank)] = frozenset(keys)
        chunks: dict[str, list[Chunk]] = {s.name: [] for s in man.shards}
        for (name, *_), chunk in zip(work, stored):
            chunks[name].append(chunk)
        return tuple(dataclasses.replace(s, file="", codec=codecs[s.name], chunks=tuple(chunks[s.name]))
                     for s in man.shards)

    async def _stored_previous(self, job: str, step: int, rank: int) -> frozenset[str] | None:
        """The chunk keys of the newest stored manifest of ``rank`` before ``step`` (the chunks a
        drain of this rank asks about; the rest is new content), an empty set when there is none,
        None (ask about every chunk) when the store cannot tell."""
        be = self.calls.be
        try:
            keys = await self.calls.read(functools.partial(be.list, job_manifests_prefix(job)))
            older = [(p[0], k) for k in keys if (p := parse_manifest_key(job, k)) and p[1] == rank and p[0] < step]
            if not older:
                return frozenset()
            body = await self.calls.read(functools.partial(be.get_bytes, max(older)[1]))
            return frozenset(object_keys(Manifest.from_json(body)))
        except Exception as err:  # an optimisation: asking about every chunk is always right
            log.debug("%s rank %d: no stored manifest to compare with (%s); asking about every chunk", job, rank, err)
            return None

    async def _hashed(self, held: Manifest, shard: str) -> list[tuple[str, int]]:
        """:meth:`.ChunkReader.hash_shard` on a codec slot (reading and hashing is codec work: no more threads
        at it than ``KNOBS.codec_threads``, each with one buffer)."""
        async with self.calls.coding:
            return await self.calls.code(functools.partial(self.reader.hash_shard, held, shard))

    async def _put_chunk(self, held: Manifest, shard: str, offset: int, digest: str, size: int, codec: str,
                         ask: bool, cancelled: Any) -> Chunk:
        """Store one chunk unless ``ask`` and its key exists (and was not found damaged): read,
        check and encode it on a codec slot (``KNOBS.codec_threads``), upload it on an upload slot,
        holding the codec slot until then (so at most that many encoded chunks wait in memory).
        Returns its manifest record."""
        be, key = self.calls.be, content_key(held.job, digest, size, codec)
        if ask and key not in self.damaged and await self.calls.write(functools.partial(be.exists, key), cancelled):
            return (digest, size, self.stored.get(key, 0))
        async with self.calls.coding:
            with self.reader.child(size) as worker:  # held until uploaded: the stored bytes are in its buffer
                if worker is None:
                    stored: bytes | memoryview = await self.calls.code(functools.partial(
                        self.reader.encoded, held, shard, offset, digest, size, codec))
                else:
                    stored = await self.calls.code(functools.partial(
                        self.reader.encoded_in, worker, held, shard, offset, digest, size, codec))
                with memoryview(stored) as view:
                    await self.calls.write(functools.partial(self._store_chunk, held, shard, key, view), cancelled)
                    return (digest, size, len(view))

    def _store_chunk(self, held: Manifest, shard: str, key: str, stored: bytes | memoryview) -> None:
        be = self.calls.be
        self.reader.yield_to_saves()  # an upload copies the chunk too: saves first (drain_yield)
        be.put_bytes(key, stored)  # a damaged chunk is replaced: its name fixes its plain bytes
        self.stored[key] = len(stored)
        if self.damaged.pop(key, None):
            be.delete([damaged_key(held.job, key)])
            log.warning("chunk %s, found damaged by a restore, stored again from %s", key, _what(held, shard))
        self.sent += len(stored)
        if self.metrics:
            self.metrics.drained_bytes.inc(len(stored))

    async def _note_damaged(self, job: str, cancelled: Any) -> None:
        """Remember the chunks a restore of any node found damaged: they are stored again."""
        notices = await self.calls.write(functools.partial(self.calls.be.list, damaged_prefix(job)), cancelled)
        for notice in notices:
            self.damaged[damaged_chunk(job, notice)] = True

    async def _wait_for_collections(self, job: str, cancelled: Any) -> None:
        """Wait while a collection of ``job`` is in flight (its marker exists), at most twice
        ``KNOBS.gc_window`` per marker from when this process first saw it (a collector that died
        leaves its marker behind; one naming this node that no collection of this process holds
        is removed now)."""
        while True:
            markers = await self.calls.write(functools.partial(self.calls.be.list, gc_prefix(job)), cancelled)
            now, dead = time.monotonic(), []
            live = []
            for key in markers:
                if self._dead_marker_of_this_node(key):
                    dead.append(key)
                elif now - self.markers_seen.setdefault(key, now) < 2 * KNOBS.gc_window:
                    live.append(key)
            if dead:
                log.warning("removing collection markers of %s that no collection of this node holds: %s", job, dead)
                await self.calls.write(functools.partial(self.calls.be.delete, dead), cancelled)
            if not live:
                return
            await asyncio.sleep(min(0.5, KNOBS.gc_window / 4))

    def _dead_marker_of_this_node(self, marker: str) -> bool:
        return bool(self.node_id) and marker.endswith(f"-{self.node_id}") and marker not in self.collecting

    async def release(self, lease: str) -> None:
        """Delete a lease (its manifest is published, or its attempt failed). Best effort: a lease
        left behind only delays the collection of its chunks until it expires."""
        try:
            await self.calls.read(functools.partial(self.calls.be.delete, [lease]), KNOBS.catalog_retry)
        except (BackendError, UnavailableError) as err:
            log.warning("could not delete the lease %s (it expires by itself): %s", lease, err)

    @staticmethod
    def check_lease(leased: float) -> None:
        """Before publishing: raise a retryable error when the lease may have expired."""
        if time.monotonic() - leased > KNOBS.lease_ttl / 2:
            raise BackendError("the drain's lease is too old to protect its chunks; starting over", retryable=True)

    # ----------------------------------------------------------------------------- download

    async def get_shard(self, job: str, shard: ShardEntry, path: Any) -> None:
        """Fill the sized staging file ``path`` with the decoded chunks of ``shard``."""
        offsets = _offsets([(d, n) for d, n, _ in shard.chunks])
        await settled(*(self.calls.read(functools.partial(self._get_chunk, job, shard.codec, c, off, path))
                         for c, off in zip(shard.chunks, offsets)))

    def _get_chunk(self, job: str, codec: str, chunk: Chunk, offset: int, path: Any) -> None:
        """Download, check and decode one chunk into ``path`` at ``offset``.

        Raises:
            DataLossError: the chunk is damaged: its manifest gives it more than
                ``KNOBS.chunk_bytes``, the object is larger than the tag byte and those bytes
                (refused before its body is read), it does not decode (each codec is bounded by
                that size), or its bytes do not hash to its name. It is remembered,
                and the next drain of this process holding those bytes stores it again.
            NotFoundError: the chunk is missing.
        """
        digest, size, _ = chunk
        key = content_key(job, digest, size, codec)
        try:
            if size > KNOBS.chunk_bytes:  # never decoded to, nor allocated, whatever the manifest says
                raise DataLossError(f"chunk {key}: {size} bytes, more than a chunk ({KNOBS.chunk_bytes})")
            try:  # stored: at most the tag byte and the plain bytes (encode() never writes more)
                stored = self.calls.be.get_bytes(key, limit=size + 1)
            except ObjectTooLargeError as err:
                raise DataLossError(f"chunk {key}: {err}") from None
            data = _checked(key, codec, stored, chunk)
        except DataLossError as err:
            self._report_damaged(job, key, err)
            raise
        self.stored[key] = len(stored)
        fd = open_checked(path, os.O_WRONLY, f"staging file {path}")  # never blocks on a planted FIFO
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)


    def _report_damaged(self, job: str, key: str, err: DataLossError) -> None:
        """Remember a damaged chunk and leave a notice for the drains of every node (best effort)."""
        self.damaged[key] = True
        log.error("%s; a drain holding its bytes stores it again", err)
        try:
            self.calls.be.put_bytes(damaged_key(job, key), b"")
        except BackendError as notice_err:
            log.warning("could not store the notice that chunk %s is damaged: %s", key, notice_err)


async def settled(*aws: Any) -> list[Any]:
    """``asyncio.gather`` that, when one fails, first lets the others finish (none writes into a
    staging file after the caller discarded it), then raises the first error."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _checked(key: str, codec: str, stored: bytes, chunk: Chunk) -> bytes | bytearray:
    """The plain bytes of a downloaded chunk, checked against its manifest record and its name."""
    from .compress import decode

    digest, size, stored_size = chunk
    try:
        data = decode(codec, stored, size)
        if xxhash.xxh3_128_hexdigest(data) != digest:
            raise DataLossError(f"chunk {key}: checksum mismatch (its bytes do not hash to its name)")
    except DataLossError as err:
        if stored_size and len(stored) != stored_size:
            raise DataLossError(f"{err} (it has {len(stored)} bytes, its manifest says {stored_size})") from None
        raise
    if stored_size and len(stored) != stored_size:  # stored again in another encoding: same bytes
        log.debug("chunk %s has %d stored bytes, its manifest says %d; its bytes check out", key, len(stored),
                  stored_size)
    return data


def _offsets(chunks: list[tuple[str, int]]) -> list[int]:
    out, pos = [], 0
    for _, n in chunks:
        out.append(pos)
        pos += n
    return out


def _what(held: Manifest, shard: str) -> str:
    return f"{held.job} step {held.step} rank {held.rank} shard {shard!r}"
