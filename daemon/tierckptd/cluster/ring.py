"""Placement on the ring of node ids: pure functions, the one home of every ring rule.

Node ids, in sorted order, form a ring. The copies of a rank saved on node O (its owner) go to
the next R nodes after O that are up. Every node computes the same answer from the same inputs;
no coordinator is involved. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

__all__ = ["after", "placement", "first_after", "copies_wanted", "neighbourhood", "in_placement", "watched"]


def after(owner: str, nodes: Iterable[str]) -> list[str]:
    """Every node of the ring (``nodes`` plus ``owner``) in ring order after ``owner``, owner excluded."""
    ring = sorted(set(nodes) | {owner})
    i = ring.index(owner)
    return ring[i + 1:] + ring[:i]


def placement(owner: str, nodes: Iterable[str], up: Collection[str], replicas: int) -> list[str]:
    """The nodes that should hold copies of ``owner``'s ranks, in order of preference.

    Args:
        owner: the node that saved the rank.
        nodes: every known node id (the owner may or may not be among them).
        up: the ids that may receive a copy now (live and not excluded).
        replicas: R.

    Returns:
        The first ``replicas`` ids of ``up`` after ``owner`` on the ring of sorted ids (fewer if
        not enough are up); never the owner.
    """
    if replicas <= 0:
        return []
    out: list[str] = []
    for node in after(owner, nodes):
        if node in up:
            out.append(node)
            if len(out) >= replicas:
                break
    return out


def first_after(owner: str, candidates: Iterable[str]) -> str | None:
    """The candidate that comes first on the ring after ``owner`` (``owner`` itself last), or
    None. The rule that picks which holder of a lost owner's rank acts for it (re-replication,
    drain take-over), so that exactly one node acts when all see the same holders."""
    cands = list(candidates)
    if not cands:
        return None
    return min(cands, key=lambda n: (n <= owner, n))


def copies_wanted(replicas: int, owner_holds: bool) -> int:
    """Copies of a rank wanted besides the owner's: R while the owner is up and holds the rank,
    else R + 1 (a stand-in for the owner's copy: down, or replaced and not restored yet)."""
    return replicas + (0 if owner_holds else 1)


def neighbourhood(node: str, nodes: Iterable[str], replicas: int) -> list[str]:
    """The nodes ``node`` exchanges data with when every node is up: its R + 1 successors (they
    hold its replicas, with one spare for a down successor and for re-replication) and its R + 1
    predecessors (it holds their replicas and may act for them). Sorted, ``node`` excluded.

    The spare on each side keeps the answer right when one neighbour is down; a node whose
    neighbours are down widens its view (see :mod:`tierckptd.cluster.membership`).
    """
    ring = after(node, nodes)
    k = max(1, replicas + 1)
    if len(ring) <= 2 * k:
        return sorted(ring)
    return sorted(set(ring[:k]) | set(ring[-k:]))


def in_placement(node: str, owner: str, nodes: Iterable[str], maybe_up: Collection[str], replicas: int) -> bool:
    """Whether ``node`` is among the first R + 1 nodes after ``owner`` in ``maybe_up`` (the nodes
    not known to be down; a node never contacted counts as up: a stricter answer, never a looser
    one). The rule a receiver applies to a replica pushed to it (one spare beyond R, for a down
    successor and for re-replication)."""
    before = 0
    for n in after(owner, nodes):
        if n == node:
            return before < max(1, replicas) + 1
        if n in maybe_up:
            before += 1
    return False


def watched(node: str, nodes: Iterable[str], maybe_up: Collection[str], replicas: int, max_widen: int) -> set[str]:
    """The neighbourhood ``node`` keeps in touch with: walking the ring both ways from it, nodes
    until R + 1 in ``maybe_up`` (not known to be down) are found on each side; each down node
    widens the walk by one, up to ``max_widen`` per side. Independent of the cluster's size."""
    succ = after(node, nodes)
    want = max(1, replicas) + 1
    out: set[str] = set()
    for side in (succ, succ[::-1]):
        alive = down = 0
        for n in side:
            if alive >= want or down > max_widen:
                break
            out.add(n)
            if n in maybe_up:
                alive += 1
            else:
                down += 1
    return out
