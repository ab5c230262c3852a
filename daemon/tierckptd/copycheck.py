"""Re-hashing stored copies (``tierckpt verify``): local ranks and persistent objects.

Nothing here changes what is stored. A copy is ``ok`` when every shard hashes to its manifest's
checksum, ``mismatch`` when one does not (or has the wrong size or kind), ``missing`` when a file
or object the manifest names is gone. The peer tier's copies are checked by their holders
(Peer.VerifyCopies runs :func:`verify_local` there).
"""

from __future__ import annotations

import functools
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.errors import DataLossError, NotFoundError

from .backends import BackendError
from .localfs import digest_fd
from .manifest import Manifest, ShardEntry
from .offload import run_blocking
from .store import LocalStore

__all__ = ["Check", "OK", "MISMATCH", "MISSING", "verify_local", "verify_persistent"]

OK, MISMATCH, MISSING = "ok", "mismatch", "missing"


@dataclass(frozen=True)
class Check:
    step: int
    rank: int
    tier: str
    node: str   # holder (local, peer) or the persistent URL
    state: str  # OK | MISMATCH | MISSING
    detail: str = ""


def _check_rank(store: LocalStore, man: Manifest) -> tuple[str, str]:
    for s in man.shards:
        try:
            fd = store.open_shard(man, s.name)
        except NotFoundError:
            return MISSING, f"shard {s.name}: file missing"
        except DataLossError as e:
            return MISMATCH, f"shard {s.name}: {e}"
        try:
            got = digest_fd(fd, s.size)
        finally:
            os.close(fd)
        if got != s.checksum:
            return MISMATCH, f"shard {s.name}: checksum {got}, manifest says {s.checksum}"
    return OK, ""


def verify_local(store: LocalStore, job: str, step: int | None, tier: str = "local") -> list[Check]:
    """Re-hash every committed rank of ``job`` (or of one step) in the local store (blocking)."""
    out = []
    for s, ranks in sorted(store.steps(job).items()):
        if step is not None and s != step:
            continue
        for rank, man in sorted(ranks.items()):
            state, detail = _check_rank(store, man)
            out.append(Check(s, rank, tier, store.node_id, state, detail))
    return out


def _hash_file(path: Path, size: int) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != size:
            return f"size {os.fstat(fd).st_size}"
        return digest_fd(fd, size)
    finally:
        os.close(fd)


async def _fetch_shard(tier: Any, man: Manifest, s: ShardEntry, path: Path) -> str:
    """Download one stored shard into ``path`` (its chunks, or its data object); returns what
    it was read from."""
    from .persistent.codec import codec_named
    from .persistent.layout import data_key, is_content

    def sized() -> None:
        with open(path, "wb") as fh:
            fh.truncate(s.size)

    await run_blocking(sized, pool=tier.calls.threads)
    if is_content(s):
        await tier.content.get_shard(man.job, s, path)
        return f"the chunks of {s.name!r}"
    key = data_key(*man.key, s)
    await tier.calls.read(lambda: codec_named(s.codec).download_into(functools.partial(tier.calls.be.get_file, key),
                                                                      path))
    return f"object {key}"


async def _check_object(tier: Any, man: Manifest, tmpdir: Path) -> tuple[str, str]:
    for s in man.shards:
        path = tmpdir / f"{s.name}.{secrets.token_hex(4)}"
        try:
            source = await _fetch_shard(tier, man, s, path)
            got = await run_blocking(_hash_file, path, s.size, pool=tier.calls.threads)
        except NotFoundError as e:
            return MISSING, f"shard {s.name}: missing: {e}"
        except (DataLossError, BackendError) as e:
            return MISMATCH, f"shard {s.name}: {e}"
        finally:
            path.unlink(missing_ok=True)
        if got != s.checksum:
            return MISMATCH, f"shard {s.name}: {source}: {got}, manifest says {s.checksum}"
    return OK, ""


async def verify_persistent(tier: Any, store: LocalStore, job: str, step: int | None) -> list[Check]:
    """Download and re-hash every rank of ``job`` (or one step) in the persistent tier, into a
    scratch directory under the local dir's ``staging/`` (reclaimed at start-up); nothing is
    committed locally."""
    cat = await tier.catalog_cache.list_steps(job)
    tmpdir = store.root / "staging" / f"verify-{secrets.token_hex(6)}"
    await run_blocking(functools.partial(os.makedirs, tmpdir, 0o750))
    out = []
    try:
        for s in sorted(cat):
            if step is not None and s != step:
                continue
            for rank in sorted(cat[s]):
                try:
                    man = await tier.catalog_cache.read_manifest(job, s, rank)
                except NotFoundError:
                    continue  # deleted since the listing
                state, detail = await _check_object(tier, man, tmpdir)
                out.append(Check(s, rank, "persistent", tier.url, state, detail))
    finally:
        await run_blocking(functools.partial(_rmtree, tmpdir))
    return out


def _rmtree(path: Path) -> None:
    for p in path.iterdir():
        p.unlink(missing_ok=True)
    path.rmdir()
