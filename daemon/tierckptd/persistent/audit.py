"""Re-hashing stored objects (``tierckpt verify`` on the persistent tier).

Every rank of a job (or of one step) with a manifest in the store is downloaded, shard by
shard, into a scratch directory under the local dir's ``staging/`` (reclaimed at start-up) and
hashed against its manifest; nothing is committed locally and nothing stored changes.
"""

from __future__ import annotations

import functools
import os
import secrets
from pathlib import Path

from tierckpt.errors import DataLossError, NotFoundError

from ..backends import BackendError
from ..local.localfs import digest_fd, open_checked
from ..local.manifest import Manifest, ShardEntry, unsigned_note
from ..local.store import LocalStore
from ..offload import run_blocking
from ..tiers import MISMATCH, MISSING, OK, Check
from .calls import BackendCalls
from .catalog import Catalog
from .codec import codec_named
from .content import ContentStore
from .layout import data_key, is_content

__all__ = ["Auditor"]


def _hash_file(path: Path, size: int) -> str:
    fd = open_checked(path, os.O_RDONLY, str(path))
    try:
        if os.fstat(fd).st_size != size:
            return f"size {os.fstat(fd).st_size}"
        return digest_fd(fd, size)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    for p in path.iterdir():
        p.unlink(missing_ok=True)
    path.rmdir()


class Auditor:
    """Re-hashes what the persistent tier at ``url`` holds (see the module docstring)."""

    def __init__(self, store: LocalStore, calls: BackendCalls, catalog: Catalog, content: ContentStore,
                 url: str) -> None:
        self.store, self.calls, self.catalog, self.content, self.url = store, calls, catalog, content, url

    async def _fetch_shard(self, man: Manifest, s: ShardEntry, path: Path) -> str:
        """Download one stored shard into ``path`` (its chunks, or its data object); returns
        what it was read from."""

        def sized() -> None:
            with open(path, "wb") as fh:
                fh.truncate(s.size)

        await run_blocking(sized, pool=self.calls.threads)
        if is_content(s):
            await self.content.get_shard(man.job, s, path)
            return f"the chunks of {s.name!r}"
        key = data_key(*man.key, s)
        get = functools.partial(self.calls.be.get_file, key)
        await self.calls.read(lambda: codec_named(s.codec).download_into(get, path))
        return f"object {key}"

    async def _check_object(self, man: Manifest, tmpdir: Path) -> tuple[str, str]:
        for s in man.shards:
            path = tmpdir / f"{s.name}.{secrets.token_hex(4)}"
            try:
                source = await self._fetch_shard(man, s, path)
                got = await run_blocking(_hash_file, path, s.size, pool=self.calls.threads)
            except NotFoundError as e:
                return MISSING, f"shard {s.name}: missing: {e}"
            except (DataLossError, BackendError) as e:
                return MISMATCH, f"shard {s.name}: {e}"
            finally:
                path.unlink(missing_ok=True)
            if got != s.checksum:
                return MISMATCH, f"shard {s.name}: {source}: {got}, manifest says {s.checksum}"
        return OK, ""

    async def verify(self, job: str, step: int | None) -> list[Check]:
        """Download and re-hash every rank of ``job`` (or one step) in the store.

        Raises:
            BackendError / UnavailableError: the store could not be listed.
        """
        cat = await self.catalog.list_steps(job, checked=False)  # forged manifests are reported, not hidden
        tmpdir = self.store.root / "staging" / f"verify-{secrets.token_hex(6)}"
        await run_blocking(functools.partial(os.makedirs, tmpdir, 0o750))
        out = []
        try:
            for s in sorted(cat):
                if step is not None and s != step:
                    continue
                for rank in sorted(cat[s]):
                    try:
                        man = await self.catalog.read_manifest(job, s, rank)
                    except NotFoundError:
                        continue  # deleted since the listing
                    except DataLossError as err:  # malformed, forged or edited: never restored
                        out.append(Check(s, rank, "persistent", self.url, MISMATCH, str(err)))
                        continue
                    state, detail = await self._check_object(man, tmpdir)
                    out.append(Check(s, rank, "persistent", self.url, state, unsigned_note(man, detail)))
        finally:
            await run_blocking(functools.partial(_rmtree, tmpdir))
        return out
