"""Collection of chunks no manifest names (content layout), safe against concurrent drains.

One pass over a job (:func:`collect`), run after retention deleted manifests:

1. Mark: store ``<job>/gc/<ms>-<token>-<node>`` (drains that see it wait, :mod:`.content`).
2. List every chunk of the job.
3. Read the references: every key named by a manifest of the job and by a lease younger than
   ``KNOBS.lease_ttl`` (a drain in flight); expired leases are deleted.
4. Sweep: delete the chunks listed in 2 and referenced by nothing read in 3, in batches, and
   stop when ``KNOBS.gc_window`` has passed since 1 began (a drain that saw the marker waits at
   most twice that from then, so however long 2 and 3 take, no delete comes after it stopped
   waiting).
5. Remove the marker.

A crash at any point deletes nothing a manifest names (manifests are read before any delete,
and a manifest published later names only chunks its lease protected or stored after the
listing); what is left is swept by the next pass. A marker left by a crash expires for drains
after twice ``KNOBS.gc_window``, and the drains of the node that left it (a new process of it)
remove it (:mod:`.content`).
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import time

from tierckpt.errors import DataLossError, NotFoundError

from ..knobs import KNOBS
from ..local.manifest import Manifest
from .calls import BackendCalls
from .layout import (
    chunk_keys,
    content_prefix,
    gc_prefix,
    job_manifests_prefix,
    lease_prefix,
    parse_manifest_key,
    stamp_of,
    stamped_key,
)

__all__ = ["collect"]

log = logging.getLogger(__name__)

_BATCH = 1000


async def collect(calls: BackendCalls, job: str, node_id: str = "", holding: set[str] | None = None) -> int:
    """One mark-and-sweep pass over ``job`` (see the module docstring); returns chunks deleted.

    Args:
        node_id: the collecting node, named in the marker.
        holding: the markers of this process's collections in flight; the marker is in it from
            before it is stored until the pass ends (this node's drains remove any other marker
            naming this node, see :mod:`.content`).

    Raises:
        BackendError, UnavailableError: the store failed (nothing unsafe was done; retry later).
    """
    be, policy = calls.be, KNOBS.catalog_retry
    marker = stamped_key(gc_prefix(job), time.time(), secrets.token_hex(6), f"-{node_id}" if node_id else "")
    marked = time.monotonic()  # before the marker can be seen
    held = holding if holding is not None else set()
    held.add(marker)
    try:
        await calls.read(functools.partial(be.put_bytes, marker, b""), policy)
    except BaseException:
        held.discard(marker)
        raise
    try:
        chunks = await calls.read(functools.partial(be.list, content_prefix(job)), policy)
        referenced = await _references(calls, job)
        doomed = [k for k in chunks if k not in referenced]
        deleted = 0
        for i in range(0, len(doomed), _BATCH):
            if time.monotonic() - marked > KNOBS.gc_window:
                log.info("collection of %s: window over after %d chunks; the next pass goes on", job, deleted)
                break
            batch = doomed[i:i + _BATCH]
            await calls.read(functools.partial(be.delete, batch), policy)
            deleted += len(batch)
        if deleted:
            log.info("collected %d unreferenced chunks of %s", deleted, job)
        return deleted
    finally:
        try:
            await calls.read(functools.partial(be.delete, [marker]), policy)
        finally:
            held.discard(marker)


async def _references(calls: BackendCalls, job: str) -> set[str]:
    """Chunk keys named by the job's manifests and live leases."""
    be, policy, out = calls.be, KNOBS.catalog_retry, set()
    for key in await calls.read(functools.partial(be.list, lease_prefix(job)), policy):
        stamp = stamp_of(lease_prefix(job), key)
        if stamp is not None and time.time() - stamp > KNOBS.lease_ttl:
            await calls.read(functools.partial(be.delete, [key]), policy)
            continue
        try:
            out.update(json.loads(await calls.read(functools.partial(be.get_bytes, key), policy))["keys"])
        except NotFoundError:
            continue  # released meanwhile: its manifest is read below
        except (ValueError, KeyError, TypeError) as err:
            raise DataLossError(f"lease {key} is malformed; collection of {job} stopped: {err}") from err
    for key in await calls.read(functools.partial(be.list, job_manifests_prefix(job)), policy):
        if parse_manifest_key(job, key) is None:
            continue
        try:
            man = Manifest.from_json(await calls.read(functools.partial(be.get_bytes, key), policy))
        except NotFoundError:
            continue  # deleted meanwhile (retention)
        out.update(k for s in man.shards for k in chunk_keys(job, s))
    return out
