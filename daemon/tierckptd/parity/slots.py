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
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt.common import checksum
from tierckpt.errors import NotFoundError

from ..local.localfs import FILE_MODE, LocalDir, check_regular, digest_fd
from ..local.manifest import Manifest
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
        with self.fs.dir(_step_dir(job, step)) as sfd:
            for name, kind in self.fs.entries(sfd):
                if name.startswith("."):
                    self.fs.unlink(sfd, name)
                elif kind == "file" and name.endswith(".json"):
                    try:
                        slot, pending = Slot.from_json(self.fs.read_small(sfd, name, _MAX_META))
                    except (OSError, ValueError, KeyError, TypeError) as e:
                        log.warning("parity slot %s of %s step %d unreadable, dropped: %s", name, job, step, e)
                        pending, slot = True, Slot(-1)
                    if pending:
                        self.fs.unlink(sfd, name)
                        self.fs.unlink(sfd, name[:-5] + ".bin")
                        log.warning("parity slot %s of %s step %d was being written at a crash: dropped", name,
                                    job, step)
                        continue
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

    def growth(self, job: str, step: int, node: str, length: int) -> int:
        """Bytes a ``length``-byte chunk of ``node``'s adds to this node's parity (it joins the
        first slot without a chunk of ``node``, as :meth:`add` does): charged before the pull."""
        with self._lock:
            slot = next((s for s in self._steps.get((job, step), {}).values()
                         if all(m.node != node for m in s.members)), None)
            return max(0, length - (slot.size if slot else 0))

    def manifests(self) -> set[str]:
        """The owners' manifests (JSON) of every member protected here (parity take-over)."""
        with self._lock:
            return {m.manifest for slots in self._steps.values() for slot in slots.values() for m in slot.members}

    def nbytes(self) -> int:
        with self._lock:
            return sum(slot.size for slots in self._steps.values() for slot in slots.values())

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
            slots = self._steps.setdefault(key, {})
            slot = next((s for s in slots.values() if all(m.node != man.node for m in s.members)), None)
            if slot is None:
                slot = slots[max(slots, default=-1) + 1] = Slot(max(slots, default=-1) + 1)
        try:
            with self.fs.dir(_step_dir(*key), create=True) as sfd:
                self.fs.atomic_write(sfd, self._name(slot.n, "json"), slot.to_json(pending=True), fsync=self.fsync)
                fd = os.open(self._name(slot.n, "bin"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, FILE_MODE, dir_fd=sfd)
                try:
                    check_regular(fd, "parity slot")
                    size = max(slot.size, length)
                    if os.fstat(fd).st_size < size:
                        os.ftruncate(fd, size)
                    xor_file_into_file(fd, tmp_fd, length)
                    if self.fsync:
                        os.fsync(fd)
                    digest = digest_fd(fd, size) if size else checksum.digest(b"")
                finally:
                    os.close(fd)
                with self._lock:
                    slot.size, slot.checksum = size, digest
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
