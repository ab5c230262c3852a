"""The Reed-Solomon parity rows held on this node: ``<local_dir>/parity-rs/<job>/<step>/``.

One row of one lane of one stripe is ``row-<stripe>-<lane>-<row>.bin`` (the row: the sum of
``a[k+row, c] * chunk`` over its members, zero-padded to the longest) and ``.json`` (stripe,
lane, row, size, xxh3 checksum, members with their data position = chunk, and the owner's
manifest), the JSON published last by rename. A member joins as in :mod:`.slots`: the chunk is
pulled into a temporary file, the JSON marked ``pending``, the row updated in place
(:meth:`.rs.Codec.update`) and the JSON rewritten; a row found ``pending`` at start-up is
dropped (its owners protect their chunks again when they see this node's new instance). A lane
holds at most one member per data position. Nothing here follows a symlink.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tierckpt.common import checksum
from tierckpt.errors import FailedPreconditionError, NotFoundError

from ..local.localfs import FILE_MODE, LocalDir, check_regular, digest_fd
from ..local.manifest import Manifest
from .rs import Codec
from .slots import Member, step_dirs

__all__ = ["RsStore", "Row", "RS_DIR"]

log = logging.getLogger(__name__)

RS_DIR = "parity-rs"
_MAX_META = 64 << 20


@dataclass
class Row:
    stripe: int
    lane: str
    row: int
    size: int = 0
    checksum: str = ""
    members: list[Member] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"row-{self.stripe:03d}-{self.lane}-{self.row:02d}"

    def to_json(self, pending: bool = False) -> bytes:
        return json.dumps({"stripe": self.stripe, "lane": self.lane, "row": self.row, "size": self.size,
                           "checksum": self.checksum, "pending": pending, "members": [vars(m) for m in self.members]},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> tuple[Row, bool]:
        d = json.loads(data)
        members = [Member(str(m["node"]), int(m["rank"]), str(m["generation"]), int(m["chunk"]), int(m["chunks"]),
                          str(m["manifest"])) for m in d["members"]]
        return cls(int(d["stripe"]), str(d["lane"]), int(d["row"]), int(d["size"]), str(d["checksum"]),
                   members), bool(d.get("pending"))


def _step_dir(job: str, step: int) -> tuple[str, str, str]:
    return (RS_DIR, job, f"{step:020d}")


class RsStore:
    """The RS rows of this node (blocking methods: call them off the event loop)."""

    def __init__(self, root: str | os.PathLike, fsync: bool = False) -> None:
        self.fs = LocalDir(Path(root))
        self.fsync = fsync
        self.token = secrets.token_hex(6)  # this start's lanes: never those of a slot dropped at a crash
        self._next = 0
        self._lock = threading.Lock()
        self._steps: dict[tuple[str, int], dict[str, Row]] = {}
        self._adding: dict[tuple[str, int], threading.Lock] = {}

    def open(self) -> None:
        self.fs.open()
        for job, step in step_dirs(self.fs, RS_DIR):
            self._load_step(job, step)

    def _load_step(self, job: str, step: int) -> None:
        with self.fs.dir(_step_dir(job, step)) as sfd:
            for name, kind in self.fs.entries(sfd):
                if name.startswith("."):
                    self.fs.unlink(sfd, name)
                elif kind == "file" and name.endswith(".json"):
                    try:
                        row, pending = Row.from_json(self.fs.read_small(sfd, name, _MAX_META))
                    except (OSError, ValueError, KeyError, TypeError) as e:
                        log.warning("parity row %s of %s step %d unreadable, dropped: %s", name, job, step, e)
                        row, pending = None, True
                    if pending or row is None or row.name + ".json" != name:
                        self.fs.unlink(sfd, name)
                        self.fs.unlink(sfd, name[:-5] + ".bin")
                        log.warning("parity row %s of %s step %d was being written at a crash: dropped", name, job,
                                    step)
                        continue
                    self._steps.setdefault((job, step), {})[row.name] = row

    # ------------------------------------------------------------------------------ queries

    def find(self, job: str, step: int, key: tuple[str, int, str, int], row: int) -> Row | None:
        with self._lock:
            return next((r for r in self._steps.get((job, step), {}).values()
                         if r.row == row and any(m.key == key for m in r.members)), None)

    def lookup(self, job: str, step: int | None = None, rank: int | None = None) -> list[tuple[Row, Member]]:
        with self._lock:
            return [(r, m) for (j, s), rows in self._steps.items() if j == job and step in (None, s)
                    for r in rows.values() for m in r.members if rank in (None, m.rank)]

    def members(self, job: str, step: int, stripe: int, lane: str, row: int) -> list[Member]:
        with self._lock:
            r = self._steps.get((job, step), {}).get(Row(stripe, lane, row).name)
            return list(r.members) if r else []

    def growth(self, job: str, step: int, stripe: int, row: int, lane: str, chunk: int, length: int) -> int:
        """Bytes a ``length``-byte chunk adds to row ``row`` (of ``lane``; row 0 without a lane:
        the first lane of the stripe with position ``chunk`` free, as :meth:`add` picks it)."""
        with self._lock:
            rows = self._steps.get((job, step), {})
            if not lane:
                lane = next((r.lane for r in sorted(rows.values(), key=lambda r: r.name)
                             if r.stripe == stripe and r.row == 0 and all(m.chunk != chunk for m in r.members)), "")
            slot = rows.get(Row(stripe, lane, row).name) if lane else None
            return max(0, length - (slot.size if slot else 0))

    def manifests(self) -> set[str]:
        """The owners' manifests (JSON) of every member protected here (parity take-over)."""
        with self._lock:
            return {m.manifest for rows in self._steps.values() for r in rows.values() for m in r.members}

    def nbytes(self) -> int:
        with self._lock:
            return sum(r.size for rows in self._steps.values() for r in rows.values())

    # ------------------------------------------------------------------------------ adding a chunk

    def incoming(self, job: str, step: int) -> tuple[str, int]:
        with self.fs.dir(_step_dir(job, step), create=True) as sfd:
            name = f".in-{secrets.token_hex(6)}"
            return name, self.fs.create(sfd, name)

    def discard(self, job: str, step: int, name: str) -> None:
        with self.fs.dir(_step_dir(job, step)) as sfd:
            self.fs.unlink(sfd, name)
        self._prune(job, step)

    def _prune(self, job: str, step: int) -> None:
        with self._lock:
            if self._steps.get((job, step)):
                return
        with contextlib.suppress(FileNotFoundError):
            with self.fs.dir((RS_DIR, job)) as jfd:
                self.fs.rmdir(jfd, f"{step:020d}")
            with self.fs.dir((RS_DIR,)) as pfd:
                self.fs.rmdir(pfd, job)

    def add(self, man: Manifest, chunk: int, codec: Codec, stripe: int, row: int, lane: str, tmp_name: str,
            tmp_fd: int, length: int) -> Row:
        """Add the pulled chunk (data position ``chunk``) to parity row ``row`` of ``lane`` (row 0
        with no lane: the first lane of the stripe with that position free, else a new one) and
        commit; the temporary file is removed.

        Raises:
            FailedPreconditionError: the lane's position is another member's.
        """
        key = (man.job, man.step)
        member = Member(man.node, man.rank, man.generation, chunk, codec.k, man.to_json().decode())
        with self._lock:
            step_lock = self._adding.setdefault(key, threading.Lock())
        try:
            with step_lock:
                with self._lock:
                    rows = self._steps.setdefault(key, {})
                    if not lane:
                        lane = next((r.lane for r in sorted(rows.values(), key=lambda r: r.name)
                                     if r.stripe == stripe and r.row == 0
                                     and all(m.chunk != chunk for m in r.members)), "")
                    if not lane:
                        lane, self._next = f"{self.token}-{self._next}", self._next + 1
                    slot = rows.setdefault(Row(stripe, lane, row).name, Row(stripe, lane, row))
                    other = next((m for m in slot.members if m.chunk == chunk), None)
                if other is not None:
                    raise FailedPreconditionError(f"lane: position {chunk} of lane {lane} of stripe {stripe} holds "
                                                  f"{other.node}'s rank {other.rank}")
                self._update(key, slot, member, codec, tmp_fd, length)
                with self.fs.dir(_step_dir(*key)) as sfd:
                    self.fs.unlink(sfd, tmp_name)
        finally:
            os.close(tmp_fd)
        return slot

    def _update(self, key: tuple[str, int], slot: Row, member: Member, codec: Codec, tmp_fd: int, length: int) -> None:
        with self.fs.dir(_step_dir(*key), create=True) as sfd:
            self.fs.atomic_write(sfd, slot.name + ".json", slot.to_json(pending=True), fsync=self.fsync)
            fd = os.open(slot.name + ".bin", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         FILE_MODE, dir_fd=sfd)
            try:
                check_regular(fd, "parity row")
                size = max(slot.size, length)
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                if length:
                    with mmap.mmap(fd, length, flags=mmap.MAP_SHARED) as dm, \
                            mmap.mmap(tmp_fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as sm:
                        dst, src = np.frombuffer(dm, dtype=np.uint8), np.frombuffer(sm, dtype=np.uint8)
                        codec.update([slot.row], [dst], member.chunk, src)
                        del dst, src  # the maps close only once no array views them
                if self.fsync:
                    os.fsync(fd)
                digest = digest_fd(fd, size) if size else checksum.digest(b"")
            finally:
                os.close(fd)
            with self._lock:
                slot.size, slot.checksum = size, digest
                slot.members.append(member)
            self.fs.atomic_write(sfd, slot.name + ".json", slot.to_json(), fsync=self.fsync)

    # ------------------------------------------------------------------------------ reading, dropping

    def open_row(self, job: str, step: int, stripe: int, lane: str, row: int) -> tuple[Row, int]:
        """A row and a read-only fd of its data (the caller closes it; NotFoundError: not here)."""
        name = Row(stripe, lane, row).name
        with self._lock:
            slot = self._steps.get((job, step), {}).get(name)
        if slot is None:
            raise NotFoundError(f"row {row} of lane {lane} of stripe {stripe} of {job} step {step} is not here")
        with self.fs.dir(_step_dir(job, step)) as sfd:
            return slot, self.fs.open_regular(sfd, name + ".bin", os.O_RDONLY, "parity row")

    def read_row(self, job: str, step: int, stripe: int, lane: str, row: int) -> tuple[Row, bytearray]:
        """A row's bytes, checked against its checksum.

        Raises:
            NotFoundError: no such row here.
            DataLossError: it fails its checksum (from :func:`_checked`).
        """
        name = Row(stripe, lane, row).name
        with self._lock:
            slot = self._steps.get((job, step), {}).get(name)
        if slot is None:
            raise NotFoundError(f"row {row} of lane {lane} of stripe {stripe} of {job} step {step} is not here")
        with self.fs.dir(_step_dir(job, step)) as sfd:
            fd = self.fs.open_regular(sfd, name + ".bin", os.O_RDONLY, "parity row")
        try:
            buf = bytearray(slot.size)
            got = os.preadv(fd, [buf], 0) if slot.size else 0
        finally:
            os.close(fd)
        return slot, buf[:got]

    def drop(self, job: str, step: int) -> int:
        with self._lock:
            rows = self._steps.pop((job, step), {})
            self._adding.pop((job, step), None)
        with contextlib.suppress(FileNotFoundError):
            with self.fs.dir((RS_DIR, job)) as jfd:
                self.fs.remove_tree(jfd, f"{step:020d}")
            self._prune(job, step)
        return len(rows)
