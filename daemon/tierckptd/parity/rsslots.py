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
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tierckpt.common import checksum
from tierckpt.errors import DataLossError, FailedPreconditionError, NotFoundError

from ..local.localfs import FILE_MODE, LocalDir, check_regular, digest_fd
from ..local.manifest import Manifest
from .rs import Codec
from .share import link_file, member_key, unshare
from .slots import Member, charged, data_ino, growth_of, load_step, same_state, step_dirs

__all__ = ["RsStore", "Row", "RS_DIR"]

RS_DIR = "parity-rs"


@dataclass
class Row:
    stripe: int
    lane: str
    row: int
    size: int = 0
    checksum: str = ""
    members: list[Member] = field(default_factory=list)
    ino: tuple[int, int] | None = None  # of its data file, once known: linked rows are charged once

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


def _apply(fs: LocalDir, fsync: bool, sfd: int, name: str, old: Row, codec: Codec,
           deltas: Sequence[tuple[int, int, int]]) -> tuple[int, str]:
    """Update a private copy of linked file ``name`` (checked against ``old``'s checksum
    first) by ``deltas``; returns its new size and checksum. Adding a chunk's share twice
    cancels it (GF(2^8) addition is XOR): old and new chunk together replace one by the other."""
    fd = fs.open_regular(sfd, name, os.O_RDWR, "parity row")
    try:
        fd = unshare(fd, sfd, name)
        if (digest_fd(fd, old.size) if old.size else checksum.digest(b"")) != old.checksum:
            raise DataLossError(f"parity row {name} fails its checksum: not updated by delta")
        size = max([old.size, *(n for _, n, _ in deltas)])
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        for src, length, position in deltas:
            if length:
                with mmap.mmap(fd, length, flags=mmap.MAP_SHARED) as dm, \
                        mmap.mmap(src, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as sm:
                    dst, data = np.frombuffer(dm, dtype=np.uint8), np.frombuffer(sm, dtype=np.uint8)
                    codec.update([old.row], [dst], position, data)
                    del dst, data  # the maps close only once no array views them
        if fsync:
            os.fsync(fd)
        return size, (digest_fd(fd, size) if size else checksum.digest(b""))
    finally:
        os.close(fd)


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
        for row in load_step(self.fs, _step_dir(job, step), Row.from_json, lambda r: r.name + ".bin", "row",
                             f"{job} step {step}"):
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

    def growth(self, job: str, step: int, stripe: int, row: int, lane: str, chunk: int, length: int,
               owner: tuple[str, int] = ("", -1)) -> int:
        """Bytes a ``length``-byte chunk (of ``owner`` = (node, rank)) adds to row ``row`` (of
        ``lane``; row 0 without a lane: the lane :meth:`add` would pick)."""
        with self._lock:
            rows = self._steps.get((job, step), {})
            if not lane:
                lane = self._lane_locked(job, step, stripe, member_key(*owner, chunk))
            slot = rows.get(Row(stripe, lane, row).name) if lane else None
            return growth_of(slot, length, self._steps)

    def held_size(self, job: str, step: int, stripe: int, lane: str, row: int) -> int:
        """Bytes of that row of ``step`` (0: none): what a delta update's private copy of it costs."""
        with self._lock:
            held = self._steps.get((job, step), {}).get(Row(stripe, lane, row).name)
            return held.size if held else 0

    def manifests(self) -> set[str]:
        """The owners' manifests (JSON) of every member protected here (parity take-over)."""
        with self._lock:
            return {m.manifest for rows in self._steps.values() for r in rows.values() for m in r.members}

    def nbytes(self) -> int:
        with self._lock:
            return charged((r.ino, r.size) for rows in self._steps.values() for r in rows.values())

    # ------------------------------------------------------------------------------ placement, sharing

    def _base_locked(self, job: str, step: int) -> tuple[int, dict[str, Row]] | None:
        held = [s for (j, s) in self._steps if j == job and s < step]
        return (max(held), self._steps[(job, max(held))]) if held else None

    def _lane_locked(self, job: str, step: int, stripe: int, key: tuple[str, int, int]) -> str:
        """The lane of ``stripe`` a chunk of ``key = (node, rank, position)`` joins at row 0: the
        lane of the base step that held the same member there, if its position is free here; else
        the first lane with the position free (and not another member's in the base); else ""
        (a new one)."""
        rows = self._steps.get((job, step), {})
        base = self._base_locked(job, step)
        brows = {r.lane: r for r in (base[1].values() if base else ()) if r.stripe == stripe and r.row == 0}
        here = {r.lane: r for r in rows.values() if r.stripe == stripe and r.row == 0}
        free = {ln for ln, r in here.items() if all(m.chunk != key[2] for m in r.members)}
        was = next((ln for ln, r in brows.items() if any(member_key(m.node, m.rank, m.chunk) == key
                                                          for m in r.members)), None)
        if was is not None and (was not in here or was in free):
            return was
        for ln in sorted(free):
            if ln not in brows or all(m.chunk != key[2] for m in brows[ln].members):
                return ln
        return ""

    def share_plan(self, man: Manifest, chunk: int, k: int, stripe: int, row: int,
                   lane: str) -> tuple[int | None, str, list[tuple[str, int, int]], str, str]:
        """Where a chunk would share (:mod:`.share`): (base step, lane ("" = a new one), the base
        row's member keys, state, the member's manifest in the base step); states as
        :meth:`.slots.ParityStore.share_plan`."""
        key = member_key(man.node, man.rank, chunk)
        with self._lock:
            base = self._base_locked(man.job, man.step)
            if not lane:
                lane = self._lane_locked(man.job, man.step, stripe, key)
            old = base[1].get(Row(stripe, lane, row).name) if base and lane else None
            was = next((m for m in old.members if member_key(m.node, m.rank, m.chunk) == key), None) if old else None
            if base is None or old is None or was is None:
                return None, lane, [], "none", ""
            if Row(stripe, lane, row).name in self._steps.get((man.job, man.step), {}):
                return base[0], lane, [], "exists", ""
            keys = [member_key(m.node, m.rank, m.chunk) for m in old.members]
        return base[0], lane, keys, same_state(was, man, k, chunk), was.manifest

    def link(self, job: str, step: int, base_step: int, stripe: int, lane: str, row: int, members: list[Member],
             codec: Codec | None = None, deltas: Sequence[tuple[int, int, int]] = ()) -> Row | None:
        """Row ``row`` of ``lane`` of ``stripe`` of ``step``: the base step's hard-linked, with
        ``members`` (those of the base row, by place). With ``deltas`` ((fd, length, position)
        of chunk files: each changed member's old and new chunk), a checked private copy of it
        updated by them (``codec``). None when the base row is gone or changed, or the row of
        ``step`` exists.

        Raises:
            DataLossError: the base row fails its checksum (a delta would hide it).
        """
        name = Row(stripe, lane, row).name
        with self._lock:
            step_lock = self._adding.setdefault((job, step), threading.Lock())
        with step_lock:
            with self._lock:
                old = self._steps.get((job, base_step), {}).get(name)
                if old is None or name in self._steps.get((job, step), {}) or sorted(
                        member_key(m.node, m.rank, m.chunk) for m in old.members) != sorted(
                        member_key(m.node, m.rank, m.chunk) for m in members):
                    return None
                slot = Row(stripe, lane, row, old.size, old.checksum, list(members))
            with self.fs.dir(_step_dir(job, base_step)) as bfd, self.fs.dir(_step_dir(job, step), create=True) as sfd:
                self.fs.atomic_write(sfd, name + ".json", slot.to_json(pending=True), fsync=self.fsync)
                try:
                    link_file(self.fs, bfd, sfd, name + ".bin")
                    if deltas:
                        assert codec is not None
                        slot.size, slot.checksum = _apply(self.fs, self.fsync, sfd, name + ".bin", old, codec, deltas)
                except BaseException:
                    self.fs.unlink(sfd, name + ".bin")
                    self.fs.unlink(sfd, name + ".json")
                    raise
                slot.ino = data_ino(self.fs, sfd, name + ".bin")
                self.fs.atomic_write(sfd, name + ".json", slot.to_json(), fsync=self.fsync)
            with self._lock:
                self._steps.setdefault((job, step), {})[name] = slot
            return slot

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
                        lane = self._lane_locked(man.job, man.step, stripe, member_key(man.node, man.rank, chunk))
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
                fd = unshare(fd, sfd, slot.name + ".bin")  # a row linked into another step
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
                st = os.fstat(fd)
            finally:
                os.close(fd)
            with self._lock:
                slot.size, slot.checksum, slot.ino = size, digest, (st.st_dev, st.st_ino)
                slot.members.append(member)
            self.fs.atomic_write(sfd, slot.name + ".json", slot.to_json(), fsync=self.fsync)

    # ------------------------------------------------------------------------------ reading, dropping

    def open_row(self, job: str, step: int, stripe: int, lane: str, row: int) -> tuple[Row, int]:
        """A row and a read-only fd of its data (the caller closes it; NotFoundError: not here)."""
        slot = self._held(job, step, stripe, lane, row)
        with self.fs.dir(_step_dir(job, step)) as sfd:
            return slot, self.fs.open_regular(sfd, slot.name + ".bin", os.O_RDONLY, "parity row")

    def _held(self, job: str, step: int, stripe: int, lane: str, row: int) -> Row:
        """The record of a row held here (NotFoundError: none)."""
        with self._lock:
            slot = self._steps.get((job, step), {}).get(Row(stripe, lane, row).name)
        if slot is None:
            raise NotFoundError(f"row {row} of lane {lane} of stripe {stripe} of {job} step {step} is not here")
        return slot

    def read_row(self, job: str, step: int, stripe: int, lane: str, row: int) -> tuple[Row, bytearray]:
        """A row's bytes, checked against its checksum.

        Raises:
            NotFoundError: no such row here.
            DataLossError: it fails its checksum (from :func:`_checked`).
        """
        slot, fd = self.open_row(job, step, stripe, lane, row)
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
