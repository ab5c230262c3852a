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
2. A member whose chunk is in the base slot *claims* its place (:class:`ShareBoard`) instead of
   pulling at once, saying whether its chunk is unchanged (:func:`same_chunk`), and waits, at
   most ``KNOBS.parity_share_wait`` seconds, for the other members of the base slot to claim
   theirs. The last one builds the slot of ``s`` for all of them: every member unchanged, the
   base file hard-linked (the store's ``link``); a few changed (:func:`worth_delta`: fewer than
   half), a private copy of the base file, checked against its checksum, updated by each
   changed member's delta (its old chunk, still held by its owner in ``b``, and its new one
   pulled: both codes are linear, and over GF(2^8) adding a share twice cancels it). Every
   claimant is answered together, so ``wait("peer")`` still resolves only once the parity of
   ``s`` is committed, and it names exactly the members of ``s``.
3. Anything else falls back to today's path, for every claimant of that slot: a member not in
   the base slot, a slot of ``s`` that already exists (a member joined it by encoding), many
   changed members, a delta that failed (the old chunk gone, the base slot corrupt), a claimant
   that waited too long (a member that never comes). The claimants then pull and encode as a
   fresh slot would; no committed parity ever depends on the base step's data.
4. A file with several links is never written in place (:func:`unshare`: copy first), so a
   member joining a base slot after it was linked, or a new member joining a linked slot, changes
   one step's parity only. Dropping ``b`` (retention, ``DropParity``) unlinks its names only: the
   inode stays for ``s``. Parity bytes are charged once per inode (the stores' ``nbytes``).

The owner side (:meth:`.encoder.Encoder._may_share`) lets a rank with an earlier step skip the
``max_parallel_ranks`` limit: otherwise ranks whose claims wait for each other could hold every
place (more ranks per node than places) until the wait expires. That limit never bounded the
owner's bandwidth under parity (each protector pulls one chunk at a time); without it more
ProtectRank calls queue on a protector at once (all the ranks of a step, not 4 per owner).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tierckpt.errors import TierckptError

from ..knobs import KNOBS
from ..local.localfs import FILE_MODE, LocalDir, check_regular
from ..local.manifest import Manifest
from . import layout
from .ranges import spans

__all__ = ["same_chunk", "member_key", "unshare", "ShareBoard", "link_file", "share", "worth_delta"]

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
    changed: int = 0  # claims whose chunk changed
    complete: asyncio.Event = field(default_factory=asyncio.Event)  # every member claimed (or broken)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ShareBoard:
    """Claims of members per slot of a step (event loop only: no lock).

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
        if c is not None:
            c.complete.set()
            self.resolve(c.done, None)

    def claim(self, ident: Hashable, want: Iterable[MemberKey], key: MemberKey, claim: Any,
              changed: bool = False) -> tuple[_Claims | None, dict[MemberKey, Any] | None]:
        """Claim ``key``'s place (None: the slot is broken, fall back); for the claimant that
        completed the set, also every claim (it links, then calls :meth:`resolve`). A slot with
        so many ``changed`` claims that a delta is not worth it is broken at once (no claimant
        waits for the rest: a step whose chunks all changed is encoded as soon as they come)."""
        if ident in self._broken:
            return None, None
        c = self._open.get(ident)
        if c is None:
            c = self._open[ident] = _Claims(frozenset(want))
        c.members[key] = claim
        c.changed += changed
        if not worth_delta(c.changed, len(c.want)):
            self.break_(ident)
            return None, None
        if set(c.members) == c.want:
            del self._open[ident]
            self._broken.add(ident)  # linked or failed: never claimed again
            c.complete.set()
            return c, dict(c.members)
        return c, None

    @staticmethod
    def resolve(fut: asyncio.Future, result: Any) -> None:
        if not fut.done():
            fut.set_result(result)

    def forget(self, pred: Any) -> None:
        """Drop the state of dropped steps (``pred(ident)`` true)."""
        for ident in [i for i in self._open if pred(i)]:
            self.break_(ident)
        self._broken = {i for i in self._broken if not pred(i)}


async def share(board: ShareBoard, ident: Hashable, want: Iterable[MemberKey], key: MemberKey, claim: Any,
                link: Callable[[dict[MemberKey, Any]], Awaitable[Any]], changed: bool = False) -> Any | None:
    """Claim ``key``'s place in slot ``ident`` and wait for the slot to be linked: the linked
    slot/row, or None (fall back: pull and encode). Claims are collected for at most
    ``KNOBS.parity_share_wait`` seconds; the claimant completing the set calls ``link(claims)``
    (None, OSError or a TierckptError: not linked) for all, and the others wait for it."""
    c, complete = board.claim(ident, want, key, claim, changed)
    if c is None:
        return None
    if complete is not None:
        done = None
        try:
            done = await link(complete)
        except (OSError, TierckptError) as e:
            log.warning("parity of %s not shared with its base step: %s", ident, e)
        finally:
            board.resolve(c.done, done)
    else:
        try:
            await asyncio.wait_for(c.complete.wait(), KNOBS.parity_share_wait)
        except TimeoutError:
            board.break_(ident)  # a member did not come: every claimant encodes
            return None
    return await asyncio.shield(c.done)


def worth_delta(changed: int, members: int) -> bool:
    """Whether updating a base slot/row by the delta of its ``changed`` members (2 chunks pulled
    each: old and new) costs less network than encoding it anew (``members`` chunks pulled)."""
    return 2 * changed < members
