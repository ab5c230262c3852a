"""The parity held on this node: slots under ``<local_dir>/parity/<job>/<step>/``.

A slot is ``slot-N.bin`` (the XOR of its members' chunks, zero-padded to the longest) and
``slot-N.json`` (its size, xxh3 checksum and members: node, rank, generation, chunk, chunks and
the owner's manifest), the JSON published last by rename. A slot holds at most one chunk per
node. A chunk joins a slot in three steps: the chunk is pulled into a temporary file next to the
slot (a network failure leaves the slot untouched), the slot's JSON is marked ``pending``, the
chunk is XORed in and the JSON rewritten with the new member and checksum. A slot found
``pending`` at start-up (a crash during the XOR) is dropped: its members protect their chunks
again at their next catch-up. Nothing here follows a symlink (:class:`..local.localfs.LocalDir`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt.common import checksum
from tierckpt.errors import DataLossError, NotFoundError, TierckptError

from ..local.localfs import FILE_MODE, LocalDir, check_regular, digest_fd
from ..local.manifest import Manifest
from .share import link_file, member_key, mirror, same_chunk, unshare
from .xor import xor_file_into_file

__all__ = ["ParityStore", "Member", "Slot", "PARITY_DIR"]

log = logging.getLogger(__name__)

PARITY_DIR = "parity"


def step_dirs(fs: LocalDir, root: str) -> list[tuple[str, int]]:
    """The ``(job, step)`` directories under ``<local_dir>/<root>/`` (created if absent), for the
    parity stores' start-up scan (XOR slots and Reed-Solomon rows); nothing followed as a symlink."""
    found = []
    with fs.dir((root,), create=True) as pfd:
        for job, kind in fs.entries(pfd):
            if kind == "dir":
                with fs.child(pfd, job) as jfd:
                    found += [(job, int(step)) for step, skind in fs.entries(jfd) if skind == "dir" and step.isdigit()]
    return found
_MAX_META = 64 << 20


def load_step(fs: LocalDir, step_dir: tuple[str, ...], parse: Callable[[bytes], tuple[Any, bool]],
              data_name: Callable[[Any], str], what: str, where: str) -> list[Any]:
    """The records (XOR slots, Reed-Solomon rows) of one step's dir at start-up, each with the
    inode of its data file: ``parse(json) -> (record, pending)``, ``data_name(record)`` its data
    file (``X.bin`` beside ``X.json``). Stray temporaries (dot names) are removed, and so is a
    record that was being written at a crash, cannot be read, or is not named as its content
    says, with its data file; nothing is followed as a symlink."""
    found = []
    with fs.dir(step_dir) as sfd:
        for name, kind in fs.entries(sfd):
            if name.startswith("."):
                fs.unlink(sfd, name)
            elif kind == "file" and name.endswith(".json"):
                try:
                    rec, pending = parse(fs.read_small(sfd, name, _MAX_META))
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("parity %s %s of %s unreadable, dropped: %s", what, name, where, e)
                    rec, pending = None, True
                if pending or rec is None or data_name(rec)[:-4] + ".json" != name:
                    fs.unlink(sfd, name)
                    fs.unlink(sfd, name[:-5] + ".bin")
                    log.warning("parity %s %s of %s was being written at a crash: dropped", what, name, where)
                    continue
                rec.ino = data_ino(fs, sfd, data_name(rec))
                found.append(rec)
    return found


def data_ino(fs: LocalDir, dir_fd: int, name: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a parity data file (not followed), None if absent."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def same_state(was: Member, man: Manifest, chunks: int, chunk: int) -> str:
    """"same" if ``man``'s chunk holds the bytes base member ``was`` held, else "changed"."""
    try:
        return "same" if was.chunks == chunks and same_chunk(Manifest.from_json(was.manifest), man, chunks,
                                                             chunk) else "changed"
    except (TierckptError, ValueError, KeyError):  # an old manifest no longer readable: encode
        return "changed"


def charged(parts) -> int:
    """Bytes of parity files ``(ino, size)``, a file linked into several steps counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for ino, size in parts:
        if ino is None or ino not in seen:
            total += size
            if ino is not None:
                seen.add(ino)
    return total


def growth_of(slot, length: int, steps) -> int:
    """Bytes that XORing a ``length``-byte chunk into ``slot`` (a :class:`Slot` or Reed-Solomon
    row, None: a new one) adds to the charge of ``steps`` (step -> its slots or rows). A file
    linked into another step is first copied whole (:func:`.share.unshare`), so the new copy is
    charged in full while the other step keeps the old one."""
    if slot is None:
        return length
    if slot.ino is not None and sum(s.ino == slot.ino for parts in steps.values() for s in parts.values()) > 1:
        return max(slot.size, length)
    return max(0, length - slot.size)


@dataclass
class Member:
    node: str
    rank: int
    generation: str
    chunk: int
    chunks: int
    manifest: str  # the owner's manifest JSON

    @property
    def key(self) -> tuple[str, int, str, int]:
        return (self.node, self.rank, self.generation, self.chunk)


@dataclass
class Slot:
    n: int
    size: int = 0
    checksum: str = ""
    members: list[Member] = field(default_factory=list)
    ino: tuple[int, int] | None = None  # of its data file, once known: linked slots are charged once

    def to_json(self, pending: bool = False) -> bytes:
        return json.dumps({"slot": self.n, "size": self.size, "checksum": self.checksum, "pending": pending,
                           "members": [vars(m) for m in self.members]}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> tuple[Slot, bool]:
        doc = json.loads(data)
        slot = cls(int(doc["slot"]), int(doc["size"]), str(doc["checksum"]),
                   [Member(str(m["node"]), int(m["rank"]), str(m["generation"]), int(m["chunk"]), int(m["chunks"]),
                           str(m["manifest"])) for m in doc["members"]])
        return slot, bool(doc.get("pending"))


def _step_dir(job: str, step: int) -> tuple[str, str, str]:
    return (PARITY_DIR, job, f"{step:020d}")


class ParityStore:
    """The parity slots of this node (blocking methods: call them off the event loop)."""

    def __init__(self, root: str | os.PathLike, fsync: bool = False) -> None:
        self.fs = LocalDir(Path(root))
        self.fsync = fsync
        self._lock = threading.Lock()
        self._steps: dict[tuple[str, int], dict[int, Slot]] = {}
        self._adding: dict[tuple[str, int], threading.Lock] = {}  # per step: chunks join slots one at a time

    # ------------------------------------------------------------------------------ start-up

    def open(self) -> None:
        """Open the parity dir and load its slots (pending ones and stray temporaries removed)."""
        self.fs.open()
        for job, step in step_dirs(self.fs, PARITY_DIR):
            self._load_step(job, step)

    def _load_step(self, job: str, step: int) -> None:
        for slot in load_step(self.fs, _step_dir(job, step), Slot.from_json, lambda sl: self._name(sl.n, "bin"),
                              "slot", f"{job} step {step}"):
            self._steps.setdefault((job, step), {})[slot.n] = slot

    # ------------------------------------------------------------------------------ queries

    def find(self, job: str, step: int, node: str, rank: int, generation: str, chunk: int) -> Slot | None:
        with self._lock:
            for slot in self._steps.get((job, step), {}).values():
                if any(m.key == (node, rank, generation, chunk) for m in slot.members):
                    return slot
        return None

    def lookup(self, job: str, step: int | None = None, rank: int | None = None) -> list[Member]:
        """Members protected here for ``job`` (one step, one rank)."""
        with self._lock:
            return [m for (j, s), slots in self._steps.items() if j == job and step in (None, s)
                    for slot in slots.values() for m in slot.members if rank in (None, m.rank)]

    def growth(self, job: str, step: int, node: str, length: int, rank: int = -1, chunk: int = -1) -> int:
        """Bytes a ``length``-byte chunk (``rank``, ``chunk``) of ``node``'s adds to this node's
        parity (in the slot :meth:`add` would pick): charged before the pull."""
        with self._lock:
            slot = self._steps.get((job, step), {}).get(self._place_locked(job, step, (node, rank, chunk)))
            return growth_of(slot, length, self._steps)

    def held_size(self, job: str, step: int, n: int) -> int:
        """Bytes of slot ``n`` of ``step`` (0: none): what a delta update's private copy of it costs."""
        with self._lock:
            slot = self._steps.get((job, step), {}).get(n)
            return slot.size if slot else 0

    def manifests(self) -> set[str]:
        """The owners' manifests (JSON) of every member protected here (parity take-over)."""
        with self._lock:
            return {m.manifest for slots in self._steps.values() for slot in slots.values() for m in slot.members}

    def nbytes(self) -> int:
        with self._lock:
            return charged((slot.ino, slot.size) for slots in self._steps.values() for slot in slots.values())

    # ------------------------------------------------------------------------------ placement, sharing

    def _base_locked(self, job: str, step: int) -> tuple[int, dict[int, Slot]] | None:
        """The latest step before ``step`` of ``job`` held here, and its slots (the base of :mod:`.share`)."""
        held = [s for (j, s) in self._steps if j == job and s < step]
        return (max(held), self._steps[(job, max(held))]) if held else None

    def _place_locked(self, job: str, step: int, key: tuple[str, int, int]) -> int:
        """The slot a chunk of ``key = (node, rank, chunk)`` joins: the slot of the base step that
        held the same member, if free of the node here; else the first slot without a chunk of
        the node (nor one in its base counterpart); else a new one."""
        slots = self._steps.get((job, step), {})
        base = self._base_locked(job, step)
        bslots = base[1] if base else {}
        free = [n for n, s in slots.items() if all(m.node != key[0] for m in s.members)]
        n = mirror(((n, [member_key(m.node, m.rank, m.chunk) for m in s.members]) for n, s in bslots.items()), key)
        if isinstance(n, int) and (n not in slots or n in free):
            return n
        for n in sorted(set(free) | (set(bslots) - set(slots))):
            if all(m.node != key[0] for m in bslots[n].members) if n in bslots else True:
                return n
        return max([*slots, *bslots], default=-1) + 1

    def share_plan(self, man: Manifest, chunk: int, chunks: int) -> tuple[int | None, int, list[tuple[str, int, int]],
                                                                          str, str]:
        """Where a chunk would share (:mod:`.share`): (base step, the slot it joins, the base
        slot's member keys, state, the member's manifest in the base step). State: "none" (no
        base member), "exists" (the slot of this step exists), "same" or "changed" (its bytes)."""
        key = member_key(man.node, man.rank, chunk)
        with self._lock:
            base = self._base_locked(man.job, man.step)
            n = self._place_locked(man.job, man.step, key)
            old = base[1].get(n) if base else None
            was = next((m for m in old.members if member_key(m.node, m.rank, m.chunk) == key), None) if old else None
            if base is None or old is None or was is None:
                return None, n, [], "none", ""
            if n in self._steps.get((man.job, man.step), {}):
                return base[0], n, [], "exists", ""
            keys = [member_key(m.node, m.rank, m.chunk) for m in old.members]
        return base[0], n, keys, same_state(was, man, chunks, chunk), was.manifest

    def link(self, job: str, step: int, base_step: int, n: int, members: list[Member],
             deltas: Sequence[tuple[int, int]] = ()) -> Slot | None:
        """Slot ``n`` of ``step``: base slot ``n`` of ``base_step`` hard-linked, with ``members``
        (those of the base slot, by place). With ``deltas`` ((fd, length) of chunk files: each
        changed member's old and new chunk), a checked private copy of it with them XORed in.
        None (nothing changed) when the base slot is gone or changed, or slot ``n`` of ``step``
        exists.

        Raises:
            DataLossError: the base slot fails its checksum (a delta would hide it).
        """
        with self._lock:
            step_lock = self._adding.setdefault((job, step), threading.Lock())
        with step_lock:
            with self._lock:
                old = self._steps.get((job, base_step), {}).get(n)
                if old is None or n in self._steps.get((job, step), {}) or sorted(
                        member_key(m.node, m.rank, m.chunk) for m in old.members) != sorted(
                        member_key(m.node, m.rank, m.chunk) for m in members):
                    return None
                slot = Slot(n, old.size, old.checksum, list(members), old.ino)
            name = self._name(n, "bin")
            with self.fs.dir(_step_dir(job, base_step)) as bfd, self.fs.dir(_step_dir(job, step), create=True) as sfd:
                self.fs.atomic_write(sfd, self._name(n, "json"), slot.to_json(pending=True), fsync=self.fsync)
                try:
                    link_file(self.fs, bfd, sfd, name)
                    if deltas:
                        slot.size, slot.checksum = self._apply(sfd, name, old, deltas)
                except BaseException:
                    self.fs.unlink(sfd, name)
                    self.fs.unlink(sfd, self._name(n, "json"))
                    raise
                slot.ino = data_ino(self.fs, sfd, name)
                self.fs.atomic_write(sfd, self._name(n, "json"), slot.to_json(), fsync=self.fsync)
            with self._lock:
                self._steps.setdefault((job, step), {})[n] = slot
            return slot

    def _apply(self, sfd: int, name: str, old: Slot, deltas: Sequence[tuple[int, int]]) -> tuple[int, str]:
        """XOR ``deltas`` into a private copy of linked file ``name`` (checked against ``old``'s
        checksum first); returns its new size and checksum."""
        fd = self.fs.open_regular(sfd, name, os.O_RDWR, "parity slot")
        try:
            fd = unshare(fd, sfd, name)
            if (digest_fd(fd, old.size) if old.size else checksum.digest(b"")) != old.checksum:
                raise DataLossError(f"parity slot {name} fails its checksum: not updated by delta")
            size = max([old.size, *(n for _, n in deltas)])
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            for src, length in deltas:
                xor_file_into_file(fd, src, length)
            if self.fsync:
                os.fsync(fd)
            return size, (digest_fd(fd, size) if size else checksum.digest(b""))
        finally:
            os.close(fd)

    @staticmethod
    def _name(n: int, ext: str) -> str:
        return f"slot-{n:06d}.{ext}"

    # ------------------------------------------------------------------------------ adding a chunk

    def incoming(self, job: str, step: int) -> tuple[str, int]:
        """A new temporary file (name, read-write fd) in the step's dir for a chunk being pulled."""
        with self.fs.dir(_step_dir(job, step), create=True) as sfd:
            name = f".in-{secrets.token_hex(6)}"
            return name, self.fs.create(sfd, name)

    def discard(self, job: str, step: int, name: str) -> None:
        """Remove a chunk's temporary file; a step or job dir left empty goes too (a refused or
        failed pull leaves nothing behind)."""
        with self.fs.dir(_step_dir(job, step)) as sfd:
            self.fs.unlink(sfd, name)
        self._prune(job, step)

    def _prune(self, job: str, step: int) -> None:
        """Remove the step's and the job's parity dirs if they are empty and hold no slot."""
        with self._lock:
            if self._steps.get((job, step)):
                return
        with contextlib.suppress(FileNotFoundError):
            with self.fs.dir((PARITY_DIR, job)) as jfd:
                self.fs.rmdir(jfd, f"{step:020d}")
            with self.fs.dir((PARITY_DIR,)) as pfd:
                self.fs.rmdir(pfd, job)

    def add(self, man: Manifest, chunk: int, chunks: int, tmp_name: str, tmp_fd: int, length: int) -> Slot:
        """XOR the pulled chunk (``length`` bytes of ``tmp_fd``) into a slot with no chunk of
        ``man.node`` and commit it; the temporary file is removed. Returns the slot."""
        key = (man.job, man.step)
        member = Member(man.node, man.rank, man.generation, chunk, chunks, man.to_json().decode())
        with self._lock:
            step_lock = self._adding.setdefault(key, threading.Lock())
        with step_lock:  # one chunk at a time per step: each joins the first slot without its node's chunk
            return self._add_locked(key, man, member, tmp_name, tmp_fd, length)

    def _add_locked(self, key: tuple[str, int], man: Manifest, member: Member, tmp_name: str, tmp_fd: int,
                    length: int) -> Slot:
        with self._lock:
            n = self._place_locked(man.job, man.step, member_key(man.node, man.rank, member.chunk))
            slot = self._steps.setdefault(key, {}).setdefault(n, Slot(n))
        try:
            with self.fs.dir(_step_dir(*key), create=True) as sfd:
                self.fs.atomic_write(sfd, self._name(slot.n, "json"), slot.to_json(pending=True), fsync=self.fsync)
                fd = os.open(self._name(slot.n, "bin"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, FILE_MODE, dir_fd=sfd)
                try:
                    check_regular(fd, "parity slot")
                    fd = unshare(fd, sfd, self._name(slot.n, "bin"))  # a slot linked into another step
                    size = max(slot.size, length)
                    if os.fstat(fd).st_size < size:
                        os.ftruncate(fd, size)
                    xor_file_into_file(fd, tmp_fd, length)
                    if self.fsync:
                        os.fsync(fd)
                    digest = digest_fd(fd, size) if size else checksum.digest(b"")
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                with self._lock:
                    slot.size, slot.checksum, slot.ino = size, digest, (st.st_dev, st.st_ino)
                    slot.members.append(member)
                self.fs.atomic_write(sfd, self._name(slot.n, "json"), slot.to_json(), fsync=self.fsync)
                self.fs.unlink(sfd, tmp_name)
        finally:
            os.close(tmp_fd)
        return slot

    # ------------------------------------------------------------------------------ reading, dropping

    def open_slot(self, job: str, step: int, node: str, rank: int, generation: str, chunk: int) -> tuple[Slot, int]:
        """The slot protecting a chunk and a read-only fd of its data (the caller closes it).

        Raises:
            NotFoundError: not protected here.
        """
        slot = self.find(job, step, node, rank, generation, chunk)
        if slot is None:
            raise NotFoundError(f"{job} step {step} rank {rank} chunk {chunk} of {node} is not protected here")
        with self.fs.dir(_step_dir(job, step)) as sfd:
            fd = self.fs.open_regular(sfd, self._name(slot.n, "bin"), os.O_RDONLY, "parity slot")
        return slot, fd

    def drop(self, job: str, step: int) -> int:
        """Remove every slot of a step; returns how many."""
        with self._lock:
            slots = self._steps.pop((job, step), {})
            self._adding.pop((job, step), None)
        with contextlib.suppress(FileNotFoundError):  # nothing of the job here: nothing to make
            with self.fs.dir((PARITY_DIR, job)) as jfd:
                self.fs.remove_tree(jfd, f"{step:020d}")
            self._prune(job, step)
        return len(slots)
