"""Progress of a restore's fetch into the local tier, for the ``RestoreProgress`` RPC.

:class:`~.restore.NodeRestore` makes one :class:`Fetch` per tier it tries and sets it as
:data:`CURRENT` around that tier's ``fetch``; the tier's code reports into it where it knows the
numbers (:func:`started` once it has read the rank's manifest, :func:`advanced` as shards land,
or a ``probe`` that counts bytes received), without a progress parameter through the tier
interface. Context variables follow the tasks the fetch starts; a fetch outside a restore (a
replica pull, a drain) has no :data:`CURRENT` and reports nothing.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Fetch", "CURRENT", "started", "advanced"]


@dataclass
class Fetch:
    """One tier's fetch of one rank: ``tier`` ("peer", "persistent"), bytes and source."""

    step: int
    tier: str
    total: int = 0
    done: int = 0
    source: str = ""
    probe: Callable[[], int] | None = None

    def bytes_done(self) -> int:
        done = self.done
        if self.probe is not None:
            try:
                done = max(done, int(self.probe()))
            except (ValueError, TypeError, RuntimeError):  # a probe racing the end of its fetch
                pass
        return min(done, self.total) if self.total else done


CURRENT: contextvars.ContextVar[Fetch | None] = contextvars.ContextVar("tierckptd_fetch", default=None)


def started(total: int, source: str = "", probe: Callable[[], int] | None = None) -> None:
    """The fetch in this context moves ``total`` bytes from ``source`` (a retry starts over)."""
    f = CURRENT.get()
    if f is not None:
        f.total, f.done, f.source, f.probe = total, 0, source, probe


def advanced(n: int) -> None:
    """``n`` more bytes of the fetch in this context have landed."""
    f = CURRENT.get()
    if f is not None:
        f.done += n
