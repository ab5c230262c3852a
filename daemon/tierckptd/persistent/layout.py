"""Object keys of the persistent tier: pure functions, the one home of the layout.

Object layout below the URL's root (``file:///dir``, ``s3://bucket/prefix``, ``gs://bucket/prefix``)::

    <job>/data/<step:020d>/rank-<rank:07d>/<shard>.<save-id>                 shard bytes
    <job>/manifests/<step:020d>/rank-<rank:07d>-of-<world:07d>.json          commit marker

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

from ..manifest import ShardEntry

__all__ = [
    "manifest_key", "data_key", "parse_manifest_key", "manifest_rank_prefix", "rank_data_prefix",
    "job_manifests_prefix", "step_manifests_prefix", "step_data_prefix",
]

_MANIFEST_RE = re.compile(r"^manifests/(\d{20})/rank-(\d{7})-of-(\d{7})\.json$")


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


def rank_data_prefix(job: str, step: int, rank: int) -> str:
    """Prefix of every data object of one rank."""
    return f"{job}/data/{step:020d}/rank-{rank:07d}/"


def job_manifests_prefix(job: str) -> str:
    """Prefix of every manifest of a job (one listing is the job's catalog)."""
    return f"{job}/manifests/"


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
