"""Re-hashing committed local ranks against their manifests (blocking).

Behind ``tierckpt verify`` (this node's copies, and a peer's when it answers Peer.VerifyCopies)
and behind a client's report that a local copy is corrupt (:mod:`tierckptd.repair`). Nothing
here changes what is stored.
"""

from __future__ import annotations

import os

from tierckpt.errors import DataLossError, NotFoundError

from ..tiers import MISMATCH, MISSING, OK, Check
from .localfs import digest_fd
from .manifest import Manifest, ShardEntry, unsigned_note
from .store import LocalStore

__all__ = ["check_rank", "corrupt_shards", "verify_local"]


def _shard_state(store: LocalStore, man: Manifest, s: ShardEntry) -> tuple[str, str]:
    """(OK | MISMATCH | MISSING, detail) of one shard of a local copy."""
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


def check_rank(store: LocalStore, man: Manifest) -> tuple[str, str]:
    """The state of a local copy: its first shard that is not OK, else (OK, "")."""
    for s in man.shards:
        state, detail = _shard_state(store, man, s)
        if state != OK:
            return state, detail
    return OK, ""


def corrupt_shards(store: LocalStore, man: Manifest) -> list[str]:
    """Names of the shards of a local copy that fail their checksum (a missing file is not this
    copy's fault: it was re-saved or evicted meanwhile)."""
    return [s.name for s in man.shards if _shard_state(store, man, s)[0] == MISMATCH]


def verify_local(store: LocalStore, job: str, step: int | None) -> list[Check]:
    """Re-hash every committed rank of ``job`` (or of one step) in the local store."""
    out = []
    for s, ranks in sorted(store.steps(job).items()):
        if step is not None and s != step:
            continue
        for rank, man in sorted(ranks.items()):
            state, detail = check_rank(store, man)
            out.append(Check(s, rank, "local", store.node_id, state, unsigned_note(man, detail)))
    return out
