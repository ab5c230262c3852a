"""Versioned catalog of the ranks this node holds, answering peers with deltas.

Each neighbour asks for "what changed since version v" (``CatalogRequest.since_version``). The
responder keeps, per held rank, the version at which it last changed, plus bounded tombstones
for ranks it dropped; a request older than the oldest tombstone it still remembers (or from
another instance of this daemon) gets a full snapshot instead. Versions come from diffing the
store's catalog against the last one seen, at most once per request, so nothing here hooks into
every code path that commits or removes a rank. Costs O(ranks held here) per request, never
O(cluster size).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from . import Key

__all__ = ["ChangeLog"]

MAX_TOMBSTONES = 65536


class ChangeLog:
    """Args:
        snapshot: returns ``{key: entry}`` of every committed rank held here; entries are
            compared with ``==`` to detect changes (e.g. a re-save with a new generation).
    """

    def __init__(self, snapshot: Callable[[], dict[Key, Any]]) -> None:
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self.version = 0
        self._current: dict[Key, Any] = {}
        self._changed_at: dict[Key, int] = {}
        self._tombstones: collections.OrderedDict[Key, int] = collections.OrderedDict()
        self._horizon = 0  # deltas since versions below this are no longer complete

    def _advance(self) -> None:
        now = self._snapshot()
        changed = [k for k, v in now.items() if self._current.get(k) != v]
        removed = [k for k in self._current if k not in now]
        if not changed and not removed:
            return
        self.version += 1
        for k in changed:
            self._changed_at[k] = self.version
            self._tombstones.pop(k, None)
        for k in removed:
            self._changed_at.pop(k, None)
            self._tombstones[k] = self.version
            self._tombstones.move_to_end(k)
        while len(self._tombstones) > MAX_TOMBSTONES:
            _, v = self._tombstones.popitem(last=False)
            self._horizon = max(self._horizon, v)
        self._current = now

    def since(self, version: int) -> tuple[int, bool, list[Any], list[Key]]:
        """``(version, delta, entries, removed)``: a delta since ``version`` when it can be given
        exactly (0 < version <= current and not older than the horizon), else a full snapshot."""
        with self._lock:
            self._advance()
            if 0 < version <= self.version and version >= self._horizon:
                entries = [self._current[k] for k, v in self._changed_at.items() if v > version]
                removed = [k for k, v in self._tombstones.items() if v > version]
                return self.version, True, entries, removed
            return self.version, False, list(self._current.values()), []
