"""Parity placement and chunking: pure functions, no I/O and no clock.

Nodes, in sorted order, are cut into placement groups of ``size = K + 1`` consecutive ids (a
remainder of one node joins the last group, so no group is left unprotected). A rank owned by
node O is cut into ``k = len(group) - 1`` chunks (its shards concatenated in manifest order,
chunk c = bytes ``[c*ceil(n/k), (c+1)*ceil(n/k))``); chunk c is protected by the c-th node after
O in its group (ring order). Every node thus protects one chunk of every other group member's
ranks and holds data as well as parity (parity rotates, as in RAID-5): memory per node
1 + 1/k of its own data. A parity slot holds at most one chunk per node, so the loss of any one
node leaves each equation with one unknown.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..cluster import ring

__all__ = ["groups", "group_of", "protectors", "chunk_span", "chunk_of"]


def groups(nodes: Iterable[str], size: int, least: int = 2) -> list[list[str]]:
    """The placement groups of the ring: consecutive sorted ids, ``size`` per group (a last group of
    fewer than ``least`` nodes joins the one before: 2 for XOR, M + 1 for Reed-Solomon)."""
    ids = sorted(set(nodes))
    out = [ids[i:i + size] for i in range(0, len(ids), max(1, size))]
    if len(out) > 1 and len(out[-1]) < least:
        out[-2].extend(out.pop())
    return out


def group_of(node: str, nodes: Iterable[str], size: int, least: int = 2) -> list[str]:
    """The group ``node`` belongs to (``node`` counted among ``nodes``)."""
    for g in groups(set(nodes) | {node}, size, least):
        if node in g:
            return g
    raise AssertionError("unreachable: every node is in a group")


def protectors(owner: str, nodes: Iterable[str], size: int) -> list[str]:
    """The nodes protecting ``owner``'s ranks, chunk 0 first: the rest of its group in ring order
    after ``owner``. Empty when the group is the owner alone (nothing can protect it)."""
    return ring.after(owner, group_of(owner, nodes, size))


def chunk_span(nbytes: int, chunks: int, chunk: int) -> tuple[int, int]:
    """(offset, length) of chunk ``chunk`` of a rank of ``nbytes`` bytes cut into ``chunks``."""
    per = -(-nbytes // max(1, chunks))
    off = min(chunk * per, nbytes)
    return off, min(nbytes, off + per) - off


def chunk_of(holder: str, owner: str, nodes: Iterable[str], size: int) -> int | None:
    """Which chunk of ``owner``'s ranks ``holder`` protects (None: none)."""
    prot = protectors(owner, nodes, size)
    return prot.index(holder) if holder in prot else None
