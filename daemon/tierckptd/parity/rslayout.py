"""Reed-Solomon placement (``parity:K+M``, M >= 2): pure functions, no I/O and no clock.

A group (:func:`.layout.groups` with ``least = M + 1``) of n nodes, in sorted order ``g``, has n
stripes and codes with ``k = n - M`` data blocks. Stripe ``s`` has its M parity rows on
``g[s], g[s+1], ..., g[s+M-1]`` (row j on ``g[s+j]``, indices mod n) and its k data blocks on the
other nodes, data block i on ``g[s+M+i]``. A node is a data node of k stripes, one per chunk: an
owner's rank is cut into k chunks (:func:`.layout.chunk_span`), chunk c is data block c of
stripe ``(x - M - c) mod n`` (x: the owner's index). Each block of a stripe is on a distinct
node, so any M lost nodes leave k blocks of every stripe; parity rotates (each node holds rows
of M stripes), memory per node 1 + M/k of its own data.

Several ranks of one owner in one step go to different *lanes* of a stripe (a lane is one set of
M rows); the holder of row 0 assigns the lane and the owner sends it to the other row holders
(:mod:`.rsencoder`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tierckpt.errors import InvalidArgumentError

from . import layout

__all__ = ["group", "data_blocks", "stripe_of", "row_holders", "targets", "roles", "check_lane", "LANE_RE"]

LANE_RE = re.compile(r"^[0-9a-f]{1,32}-[0-9]{1,9}$")
"""A lane: the assigning holder's start token and a counter (hostile input: checked)."""


def group(node: str, nodes: Iterable[str], k: int, m: int) -> list[str]:
    return layout.group_of(node, nodes, k + m, m + 1)


def data_blocks(g: list[str], m: int) -> int:
    """k of a group: its size less M (0: the group cannot be protected)."""
    return max(0, len(g) - m)


def stripe_of(owner: str, g: list[str], m: int, chunk: int) -> int:
    return (g.index(owner) - m - chunk) % len(g)


def row_holders(stripe: int, g: list[str], m: int) -> list[str]:
    """The holders of the stripe's rows, row 0 first."""
    return [g[(stripe + j) % len(g)] for j in range(m)]


def targets(owner: str, g: list[str], m: int) -> list[tuple[str, int, int]]:
    """(holder, chunk, row) for every parity row protecting ``owner``'s ranks, chunk by chunk,
    row 0 first (empty when the group has no data block besides parity)."""
    k = data_blocks(g, m)
    if owner not in g or k < 1:
        return []
    return [(h, c, j) for c in range(k) for j, h in enumerate(row_holders(stripe_of(owner, g, m, c), g, m))]


def roles(holder: str, owner: str, g: list[str], m: int) -> set[tuple[int, int]]:
    """(chunk, row) pairs of ``owner``'s ranks that ``holder`` protects."""
    return {(c, j) for h, c, j in targets(owner, g, m) if h == holder}


def check_lane(lane: str, row: int) -> None:
    """A lane from a peer: empty only for row 0 (the holder of row 0 assigns one).

    Raises:
        InvalidArgumentError: naming the field.
    """
    if lane == "" and row == 0:
        return
    if len(lane) > 48 or not LANE_RE.match(lane):
        raise InvalidArgumentError(f"lane: {lane[:48]!r} is not a lane (token-counter; row > 0 needs one)")
