"""Storing and fetching ranks in the content layout (:mod:`.layout`): chunks by hash, deduplicated.

Upload of one rank (:meth:`ContentStore.put_rank`), in this order:

1. Hash: every shard is read once from the local store through a
   :class:`~.verify.VerifyingReader` (the whole shard must match its checksum, or nothing is
   published) and every chunk's xxh3-128 is taken: the chunk keys are now known.
2. Lease: ``<job>/leases/<ms>-<token>.json`` listing those keys is stored.
3. Collections: while a collection marker ``<job>/gc/...`` exists, wait (see :mod:`.gc`).
4. Chunks (of all shards at once, ``KNOBS.upload_threads`` at a time): each chunk whose key
   exists is skipped (deduplicated); the others are read again, checked against their hash (so
   every byte sent was verified), encoded and stored. Whether a chunk exists is asked (one
   request each) for the chunks the last drain of the same rank by this process also had, and
   for every chunk when this process has drained no such rank yet (after a restart); a chunk
   that drain did not have is new content and is stored without asking (at worst an identical
   object is written again), so a step where everything changed costs no extra request per chunk.
5. The caller publishes the manifest (commit marker), then :meth:`release` deletes the lease.

Why it is safe against a concurrent collection: a collection stores its marker, then reads the
leases and manifests, deletes, and removes its marker. If the drain saw no marker (3), any
collection that marks later reads this lease (2 came before 3), so it deletes none of these
chunks; if it saw one, it waited for that collection to finish before checking existence (4),
so a chunk that collection deleted is stored again.
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
from tierckpt.errors import DataLossError

from ..backends import BackendError
from ..knobs import KNOBS
from ..manifest import Manifest, ShardEntry
from ..store import LocalStore
from .calls import BackendCalls
from .layout import content_key, gc_prefix, lease_prefix, stamped_key
from .ledger import Bounded
from .verify import VerifyingReader

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
    """

    def __init__(self, store: LocalStore, calls: BackendCalls, setting: str, metrics: Any = None) -> None:
        self.store = store
        self.calls = calls
        self.setting = setting
        self.metrics = metrics
        self.stored: Bounded = Bounded(1 << 20)  # chunk key -> stored size, of chunks seen by this process
        self.previous: Bounded = Bounded(256)  # (job, rank) -> chunk keys of its last drain by this process
        self.sent = 0  # stored bytes uploaded by this process (benchmarks)

    # ----------------------------------------------------------------------------- upload

    async def put_rank(self, held: Manifest, man: Manifest, cancelled: Any) -> tuple[Manifest, str, float]:
        """Steps 1-4 of the module docstring for the rank ``held`` (the local copy) in its stored
        form ``man``. Returns the manifest to publish, the lease key and when it was stored.

        Raises:
            DataLossError: a local shard does not match its checksum (nothing is published).
            Stopped, BackendError, OSError: as :meth:`RankUploader.upload`.
        """
        job = man.job
        codecs = {s.name: _codec_for(self.setting, s.dtype) for s in man.shards}
        hashed = await asyncio.gather(*(self.calls.write(functools.partial(self._hash_shard, held, s.name),
                                                         cancelled) for s in man.shards))
        plan = dict(zip((s.name for s in man.shards), hashed))
        keys = sorted({content_key(job, d, n, codecs[name]) for name, chunks in plan.items() for d, n in chunks})
        lease = stamped_key(lease_prefix(job), time.time(), secrets.token_hex(6), ".json")
        leased = time.monotonic()
        body = json.dumps({"created": time.time(), "keys": keys}).encode()
        await self.calls.write(functools.partial(self.calls.be.put_bytes, lease, body), cancelled)
        await self._wait_for_collections(job, cancelled)
        # every chunk of every shard at once (KNOBS.upload_threads at a time): a rank of many
        # one-chunk shards would otherwise go up one shard after the other
        work = [(s.name, off, d, n) for s in man.shards for (d, n), off in zip(plan[s.name], _offsets(plan[s.name]))]
        previous = self.previous.get((job, man.rank))
        stored = await asyncio.gather(*(
            self.calls.write(functools.partial(self._put_chunk, held, name, off, d, n, codecs[name],
                                               previous is None or content_key(job, d, n, codecs[name]) in previous),
                             cancelled)
            for name, off, d, n in work))
        self.previous[(job, man.rank)] = frozenset(keys)
        chunks: dict[str, list[Chunk]] = {s.name: [] for s in man.shards}
        for (name, *_), chunk in zip(work, stored):
            chunks[name].append(chunk)
        shards = tuple(dataclasses.replace(s, file="", codec=codecs[s.name], chunks=tuple(chunks[s.name]))
                       for s in man.shards)
        return dataclasses.replace(man, shards=shards), lease, leased

    def _hash_shard(self, held: Manifest, shard: str) -> list[tuple[str, int]]:
        """(xxh3-128 hex, size) of every chunk of a local shard, verifying the shard's checksum."""
        entry, size = held.shard(shard), KNOBS.chunk_bytes
        fd = self._open(held, shard)
        try:
            src = VerifyingReader(fd, entry.size, entry.checksum, _what(held, shard))
            out = []
            while True:
                data = src.read(size)
                if not data:
                    break
                out.append((xxhash.xxh3_128_hexdigest(data), len(data)))
            src.check()
            return out
        finally:
            os.close(fd)

    def _open(self, held: Manifest, shard: str) -> int:
        from tierckpt.errors import NotFoundError

        try:
            return self.store.open_shard(held, shard)  # no link followed; a regular file of its size
        except NotFoundError as err:  # evicted or re-saved meanwhile: the rank left the local tier
            raise FileNotFoundError(str(err)) from err

    def _put_chunk(self, held: Manifest, shard: str, offset: int, digest: str, size: int, codec: str,
                   ask: bool) -> Chunk:
        """Store one chunk unless ``ask`` and its key exists; returns its manifest record."""
        from .compress import encode

        be, key = self.calls.be, content_key(held.job, digest, size, codec)
        if ask and be.exists(key):
            return (digest, size, self.stored.get(key, 0))
        fd = self._open(held, shard)
        data = bytearray(size)  # ours: the codec may compress it in place (no copy)
        try:
            got = os.preadv(fd, [data], offset)
        finally:
            os.close(fd)
        if got != size or xxhash.xxh3_128_hexdigest(data) != digest:
            raise DataLossError(f"{_what(held, shard)}: the local copy changed while uploading "
                                f"(chunk at {offset}); not published")
        stored = encode(codec, data, consume=True)
        be.put_bytes(key, stored)
        self.stored[key] = len(stored)
        self.sent += len(stored)
        if self.metrics:
            self.metrics.drained_bytes.inc(len(stored))
        return (digest, size, len(stored))

    async def _wait_for_collections(self, job: str, cancelled: Any) -> None:
        """Wait while a collection of ``job`` is in flight (its marker exists), at most twice
        ``KNOBS.gc_window`` per marker (a collector that died leaves its marker behind)."""
        first_seen: dict[str, float] = {}
        while True:
            markers = await self.calls.write(functools.partial(self.calls.be.list, gc_prefix(job)), cancelled)
            now = time.monotonic()
            live = [k for k in markers if now - first_seen.setdefault(k, now) < 2 * KNOBS.gc_window]
            if not live:
                return
            await asyncio.sleep(min(0.5, KNOBS.gc_window / 4))

    async def release(self, lease: str, leased: float, cancelled: Any) -> None:
        """Delete a lease once its manifest is published."""
        await self.calls.write(functools.partial(self.calls.be.delete, [lease]), cancelled)

    @staticmethod
    def check_lease(leased: float) -> None:
        """Before publishing: raise a retryable error when the lease may have expired."""
        if time.monotonic() - leased > KNOBS.lease_ttl / 2:
            raise BackendError("the drain's lease is too old to protect its chunks; starting over", retryable=True)

    # ----------------------------------------------------------------------------- download

    async def get_shard(self, job: str, shard: ShardEntry, path: Any) -> None:
        """Fill the sized staging file ``path`` with the decoded chunks of ``shard``."""
        offsets = _offsets([(d, n) for d, n, _ in shard.chunks])
        await asyncio.gather(*(self.calls.read(functools.partial(self._get_chunk, job, shard.codec, c, off, path))
                               for c, off in zip(shard.chunks, offsets)))

    def _get_chunk(self, job: str, codec: str, chunk: Chunk, offset: int, path: Any) -> None:
        from .compress import decode

        digest, size, _ = chunk
        key = content_key(job, digest, size, codec)
        stored = self.calls.be.get_bytes(key)
        self.stored[key] = len(stored)
        data = decode(codec, stored, size)
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)


def _offsets(chunks: list[tuple[str, int]]) -> list[int]:
    out, pos = [], 0
    for _, n in chunks:
        out.append(pos)
        pos += n
    return out


def _what(held: Manifest, shard: str) -> str:
    return f"{held.job} step {held.step} rank {held.rank} shard {shard!r}"
