"""Unchanged chunks share their parity with the base step (issue 32 item 4, both codes).

A protector keeps, per step, slots (XOR) or rows (Reed-Solomon) whose members are chunks of
several owners. When a step ``s`` arrives whose chunks are byte-identical to those of the latest
step ``b < s`` of the job held here (the *base*: content-addressed incremental saves link
unchanged shards, so their manifest checksums match), the slot or row of ``b`` that held exactly
those members is the slot or row of ``s`` already: it is hard-linked into ``s`` instead of
pulling and encoding the chunks again (no network, no encoding, no new bytes on disk).

What makes that possible:

1. Placement mirrors the base: a member that was in slot ``n`` (XOR) or lane ``L`` (RS) of ``b``
   joins slot ``n`` / lane ``L`` of ``s`` (:func:`mirror`), so the membership of a slot does not
   depend on arrival order from one step to the next.
2. A member whose chunk is unchanged (:func:`same_chunk`) does not pull at once: it *claims* its
   place (:class:`ShareBoard`) and waits, at most ``KNOBS.parity_share_wait`` seconds, for the
   other members of the base slot to claim theirs. The last one links the base file (the store's
   ``link``) and every claimant is answered together: ``wait("peer")`` still resolves only once
   the parity of ``s`` is committed, and it names exactly the members of ``s``.
3. Anything else falls back to today's path, for every claimant of that slot: a member whose
   chunk changed, a slot of ``s`` that already exists (a member joined it by XOR), a claimant
   that waited too long (a member that never comes). The claimants then pull and encode as a
   fresh slot would; nothing is shared half-way, so no parity ever depends on the base step's
   data once committed.
4. A file with several links is never written in place (:func:`unshare`: copy first), so a
   member joining a base slot after it was linked, or a new member joining a linked slot, changes
   one step's parity only. Dropping ``b`` (retention, ``DropParity``) unlinks its names only: the
   inode stays for ``s``. Parity bytes are charged once per inode (the stores' ``nbytes``).

Not done: a partially changed slot is encoded anew (all its members pulled) rather than updated
by the delta of its changed members (both codes are linear, but the old chunk of a changed
member would have to be pulled as well: its owner may have dropped it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..knobs import KNOBS
from ..local.localfs import FILE_MODE, LocalDir, check_regular
from ..local.manifest import Manifest
from ..offload import run_blocking
from . import layout
from .ranges import spans

__all__ = ["same_chunk", "member_key", "unshare", "ShareBoard", "link_file", "share"]

log = logging.getLogger(__name__)

MemberKey = tuple[str, int, int]
"""(owner node, rank, chunk): a member's place from one step to the next (the generation differs)."""


def member_key(node: str, rank: int, chunk: int) -> MemberKey:
    return (node, rank, chunk)


def _chunk_content(man: Manifest, chunks: int, chunk: int) -> tuple[int, list[tuple[str, int, int, int]]]:
    off, length = layout.chunk_span(man.nbytes, chunks, chunk)
    return length, [(man.shard(name).checksum, man.shard(name).size, start, count)
                    for name, start, count, _ in spans(man, off, length)]


def same_chunk(old: Manifest, new: Manifest, chunks: int, chunk: int) -> bool:
    """Whether chunk ``chunk`` of ``new``'s rank holds the same bytes as in ``old`` (same length,
    and cut from shards of the same checksums at the same offsets). Pure."""
    if (old.node, old.rank, old.job) != (new.node, new.rank, new.job):
        return False
    return _chunk_content(old, chunks, chunk) == _chunk_content(new, chunks, chunk)


def unshare(fd: int, dir_fd: int, name: str) -> int:
    """``fd`` (read-write, of entry ``name`` in ``dir_fd``) if its file has one link; else a
    private copy of it put in its place by rename (the old fd closed), so that writing in place
    changes this name only. Nothing followed as a symlink."""
    st = check_regular(fd, "parity file")
    if st.st_nlink <= 1:
        return fd
    tmp = f".cow-{name}"
    out = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        pos = 0
        while pos < st.st_size:
            n = os.copy_file_range(fd, out, st.st_size - pos, pos, pos)
            if n <= 0:
                raise OSError(f"parity file {name}: short copy")
            pos += n
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.close(out)
        LocalDir.unlink(dir_fd, tmp)
        raise
    os.close(fd)
    return out


def link_file(fs: LocalDir, src_dir: int, dst_dir: int, name: str) -> None:
    """Hard-link regular file ``name`` of ``src_dir`` into ``dst_dir`` (never following a
    symlink; a file replaced meanwhile is refused).

    Raises:
        OSError: not linked (the caller falls back to encoding).
    """
    fd = fs.open_regular(src_dir, name, os.O_RDONLY, f"parity file {name}")
    try:
        ident = os.fstat(fd)
    finally:
        os.close(fd)
    os.link(name, name, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
    if not fs.same_file(dst_dir, name, ident):
        fs.unlink(dst_dir, name)
        raise OSError(f"parity file {name} was replaced while being linked")


def mirror(base: Iterable[tuple[Hashable, Iterable[MemberKey]]], key: MemberKey) -> Hashable | None:
    """The slot (or lane) of the base step that held ``key``; None if none did."""
    return next((ident for ident, keys in base if key in set(keys)), None)


@dataclass
class _Claims:
    want: frozenset[MemberKey]
    members: dict[MemberKey, Any] = field(default_factory=dict)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ShareBoard:
    """Claims of unchanged members per slot of a step (event loop only: no lock).

    A slot is identified by whatever the store names it by (``(job, step, slot)``,
    ``(job, step, stripe, lane, row)``); once broken it stays broken (a late claimant pulls).
    """

    def __init__(self) -> None:
        self._open: dict[Hashable, _Claims] = {}
        self._broken: set[Hashable] = set()

    def break_(self, ident: Hashable) -> None:
        """No sharing for this slot: every claimant falls back."""
        self._broken.add(ident)
        c = self._open.pop(ident, None)
        if c is not None and not c.done.done():
            c.done.set_result(None)

    def claim(self, ident: Hashable, want: Iterable[MemberKey], key: MemberKey,
              member: Any) -> tuple[asyncio.Future, dict[MemberKey, Any] | None]:
        """Claim ``key``'s place; returns the future every claimant awaits (the shared slot, or
        None: fall back) and, for the claimant that completed the set, the members to link
        (it links and then calls :meth:`resolve`)."""
        if ident in self._broken:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut, None
        c = self._open.get(ident)
        if c is None:
            c = self._open[ident] = _Claims(frozenset(want))
        c.members[key] = member
        if set(c.members) == c.want:
            del self._open[ident]
            self._broken.add(ident)  # linked or failed: never claimed again
            return c.done, dict(c.members)
        return c.done, None

    @staticmethod
    def resolve(fut: asyncio.Future, result: Any) -> None:
        if not fut.done():
            fut.set_result(result)

    def forget(self, pred: Any) -> None:
        """Drop the state of dropped steps (``pred(ident)`` true)."""
        for ident in [i for i in self._open if pred(i)]:
            self.break_(ident)
        self._broken = {i for i in self._broken if not pred(i)}


async def share(board: ShareBoard, ident: Hashable, want: Iterable[MemberKey], key: MemberKey, member: Any,
                link: Callable[[list[Any]], Any]) -> Any | None:
    """Claim ``key``'s place in slot ``ident`` and wait for the slot to be linked: the linked
    slot/row, or None (fall back: pull and encode). The claimant completing the set calls
    ``link(members)`` (blocking; None or OSError: not linked) for all."""
    fut, complete = board.claim(ident, want, key, member)
    if complete is not None:
        done = None
        try:
            done = await run_blocking(link, list(complete.values()))
        except OSError as e:
            log.warning("parity of %s not shared with its base step: %s", ident, e)
        finally:
            board.resolve(fut, done)
    try:
        return await asyncio.wait_for(asyncio.shield(fut), KNOBS.parity_share_wait)
    except TimeoutError:
        board.break_(ident)  # a member did not come: every claimant encodes
        return None
