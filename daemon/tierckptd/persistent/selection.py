"""Which ranks go to the persistent tier, and which steps retention removes: pure planning.

Selection: a rank committed on this node is drained when its save asked for it (``persist=True``)
or ``persist_every > 0 and step % persist_every == 0``. Each node drains the ranks it owns
(``manifest.node == node_id``); replicas from peers and copies downloaded from the persistent
tier (``ingested=True``) are not drained, except by a take-over (:mod:`.takeover`).

Retention (``keep_persistent`` N > 0): after a drain, steps older than the N-th newest complete
step are deleted, manifests first, then data (:mod:`.retention` executes the plan).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..local.manifest import Manifest

__all__ = ["selected", "step_selected", "not_selected_reason", "plan_retention"]


def step_selected(step: int, persist: bool, persist_every: int) -> bool:
    """Whether a save of ``step`` (with its ``persist`` flag) goes to the persistent tier."""
    return persist or (persist_every > 0 and step % persist_every == 0)


def selected(man: Manifest, persist_every: int) -> bool:
    """Whether a committed rank goes to the persistent tier."""
    return step_selected(man.step, man.persist, persist_every)


def not_selected_reason(man: Manifest, persist_every: int) -> str:
    """The message ``wait`` gives for a rank that is not drained."""
    return (f"{man.job} step {man.step} is not selected for the persistent tier: "
            f"persist_every={persist_every} and persist=False")


def plan_retention(steps: Mapping[int, Mapping[int, int]], keep: int) -> list[int]:
    """Steps to delete so that ``keep`` complete steps remain (oldest complete kept included).

    Args:
        steps: step -> rank -> world size, as found in the persistent tier.
        keep: newest complete steps to keep; 0 keeps everything.

    Returns:
        Every step older than the ``keep``-th newest complete step, ascending (complete or not).
    """
    if keep <= 0:
        return []
    complete = sorted(s for s, ranks in steps.items()
                      if ranks and len(set(ranks.values())) == 1 and len(ranks) == next(iter(ranks.values())))
    if len(complete) <= keep:
        return []
    cutoff = complete[-keep]
    return sorted(s for s in steps if s < cutoff)
