"""Object keys of the persistent tier: pure functions, the one home of the layout.

Object layout below the URL's root (``file:///dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``)::

    <job>/content/<h[:2]>/<h>-<size>.<codec>                                 one chunk (content layout)
    <job>/manifests/<step:020d>/rank-<rank:07d>-of-<world:07d>.json          commit marker
    <job>/manifests/<step:020d>/deleted.json                                 the step was deleted (a tombstone)
    <job>/leases/<unix-ms:013d>-<token>.json                                 a drain in flight (see :mod:`.gc`)
    <job>/gc/<unix-ms:013d>-<token>-<node>                                   a collection in flight
    <job>/damaged/<h[:2]>/<h>-<size>.<codec>                                 a chunk a restore found damaged
    <job>/data/<step:020d>/rank-<rank:07d>/<shard>.<save-id>                 shard bytes (per-shard layout)

Content layout (what drains write): a shard is cut into chunks of ``KNOBS.chunk_bytes`` (the last
one shorter); a chunk is named by the xxh3-128 of its plain bytes, its plain size and the codec
it is stored with (:mod:`.compress`), so the same bytes stored the same way are one object, shared
by every step and rank of the job that holds them, and a drain learns whether a chunk is already
stored from its name alone. The manifest's ``shards[].chunks`` lists ``[hash, size, stored size]``
in order and ``shards[].codec`` the codec; ``shards[].file`` is empty. Chunks no manifest names
are collected by :mod:`.gc`. A restore that finds a chunk damaged (it does not hash to its name)
stores an empty notice under ``damaged/`` with the chunk's name; the next drain of any node that
holds those bytes stores the chunk again (repairing every step that names it) and deletes the
notice. The name is 128 bits of xxh3 plus the size rather than a
cryptographic hash: an accidental collision needs ~2^64 chunks, the name is only compared within
one job, whose writers can replace its data anyway, restores still verify each shard's
checksum, and xxh3-128 hashes at ~20 GB/s where sha256/blake2b run at 0.3 GB/s on one core here,
which would bound the drain.

Per-shard layout (written by daemons before the content layout, and by tiers built with a
:class:`~.codec.ShardCodec`; still read):

The manifest object is the local per-rank manifest JSON unchanged (a shard stored through a
codec other than the identity also names it, see :mod:`.codec`): its ``shards[].file`` fields
name the data objects of the rank (``<shard>.<save-id>``, so a re-save never overwrites bytes
that an older manifest still names). It is uploaded only after every data object of the rank is
stored, so a reader never sees a rank whose shards are missing or partial. A step is complete in
this tier when every rank ``0..world-1`` has a manifest. Manifests live under their own prefix
and carry the world size in their name, so the catalog of a job is one listing, with no reads.
"""

from __future__ import annotations

import re

from tierckpt.errors import DataLossError

from ..local.manifest import Manifest, ShardEntry
from .codec import is_chunk_codec

__all__ = [
    "manifest_key", "data_key", "parse_manifest_key", "manifest_rank_prefix", "rank_data_prefix",
    "job_manifests_prefix", "step_manifests_prefix", "step_data_prefix",
    "content_key", "content_prefix", "is_content", "chunk_keys", "object_keys",
    "tombstone_key", "parse_tombstone_key",
    "lease_prefix", "gc_prefix", "damaged_prefix", "damaged_key", "damaged_chunk", "stamped_key", "stamp_of",
]

_MANIFEST_RE = re.compile(r"^manifests/(\d{20})/rank-(\d{7})-of-(\d{7})\.json$")
_TOMBSTONE_RE = re.compile(r"^manifests/(\d{20})/deleted\.json$")


def manifest_key(job: str, step: int, rank: int, world_size: int) -> str:
    """Object key of a rank's manifest (the commit marker)."""
    return f"{job}/manifests/{step:020d}/rank-{rank:07d}-of-{world_size:07d}.json"


def manifest_rank_prefix(job: str, step: int, rank: int) -> str:
    """Prefix of every manifest key of one rank (whatever its world size)."""
    return f"{job}/manifests/{step:020d}/rank-{rank:07d}-of-"


def data_key(job: str, step: int, rank: int, shard: ShardEntry) -> str:
    """Object key of one shard's bytes (``shard.file`` is ``<name>.<save-id>``).

    Raises:
        DataLossError: the shard names no object (a malformed manifest).
    """
    if not shard.file:
        raise DataLossError(f"manifest of {job} step {step} rank {rank}: shard {shard.name!r} names no object")
    return f"{rank_data_prefix(job, step, rank)}{shard.file}"


def is_content(shard: ShardEntry) -> bool:
    """Whether a manifest's shard is stored in the content layout (chunks, no data file)."""
    return bool(shard.chunks) or (not shard.file and is_chunk_codec(shard.codec))


def content_key(job: str, digest: str, size: int, codec: str) -> str:
    """Object key of one chunk: its plain bytes' xxh3-128 (hex), plain size and codec."""
    return f"{job}/content/{digest[:2]}/{digest}-{size}.{codec}"


def chunk_keys(job: str, shard: ShardEntry) -> list[str]:
    """Object keys of a content-layout shard's chunks, in order (none for a per-shard one)."""
    return [content_key(job, d, n, shard.codec) for d, n, _ in shard.chunks] if is_content(shard) else []


def object_keys(man: Manifest) -> set[str]:
    """Every data object a stored manifest names: its chunks (content layout) or its shards' data
    objects (per-shard layout).

    Raises:
        DataLossError: a per-shard shard names no object (a malformed manifest).
    """
    out: set[str] = set()
    for s in man.shards:
        out.update(chunk_keys(man.job, s) if is_content(s) else (data_key(*man.key, s),))
    return out


def content_prefix(job: str) -> str:
    """Prefix of every chunk of a job."""
    return f"{job}/content/"


def damaged_prefix(job: str) -> str:
    """Prefix of the notices of chunks found damaged."""
    return f"{job}/damaged/"


def damaged_key(job: str, chunk: str) -> str:
    """The notice that the chunk ``chunk`` (a :func:`content_key` of ``job``) was found damaged."""
    return damaged_prefix(job) + chunk[len(content_prefix(job)):]


def damaged_chunk(job: str, notice: str) -> str:
    """The chunk key a :func:`damaged_key` notice names."""
    return content_prefix(job) + notice[len(damaged_prefix(job)):]


def lease_prefix(job: str) -> str:
    """Prefix of the leases of drains in flight."""
    return f"{job}/leases/"


def gc_prefix(job: str) -> str:
    """Prefix of the markers of collections in flight."""
    return f"{job}/gc/"


def stamped_key(prefix: str, wall: float, token: str, suffix: str = "") -> str:
    """``<prefix><unix-ms:013d>-<token><suffix>``: a lease or marker naming when it was made."""
    return f"{prefix}{int(wall * 1000):013d}-{token}{suffix}"


def stamp_of(prefix: str, key: str) -> float | None:
    """The wall time a :func:`stamped_key` names (None for another key)."""
    m = re.match(r"^(\d{13})-", key[len(prefix):]) if key.startswith(prefix) else None
    return int(m.group(1)) / 1000 if m else None


def rank_data_prefix(job: str, step: int, rank: int) -> str:
    """Prefix of every data object of one rank."""
    return f"{job}/data/{step:020d}/rank-{rank:07d}/"


def job_manifests_prefix(job: str) -> str:
    """Prefix of every manifest of a job (one listing is the job's catalog)."""
    return f"{job}/manifests/"


def tombstone_key(job: str, step: int) -> str:
    """Object key of a step's tombstone (:mod:`.tombstone`): beside its manifests, so the job's
    one listing shows it."""
    return f"{job}/manifests/{step:020d}/deleted.json"


def parse_tombstone_key(job: str, key: str) -> int | None:
    """The step a :func:`tombstone_key` of ``job`` names, or None for any other key."""
    head = job + "/"
    m = _TOMBSTONE_RE.match(key[len(head):]) if key.startswith(head) else None
    return int(m.group(1)) if m else None


def step_manifests_prefix(job: str, step: int) -> str:
    """Prefix of every manifest of one step."""
    return f"{job}/manifests/{step:020d}/"


def step_data_prefix(job: str, step: int) -> str:
    """Prefix of every data object of one step."""
    return f"{job}/data/{step:020d}/"


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
