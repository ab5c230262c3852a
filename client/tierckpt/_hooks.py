"""Waiting for ``staged`` where the next update would overwrite the saved tensors.

The torch integrations save tensors that are copied after ``save()`` returned (see
:mod:`tierckpt._staging`); the trainer may not change them before the save's ``staged``. A
:class:`StagedWaiter` holds the ``staged`` futures of one saver and, while it is open, a global
optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) that waits
for them before any optimizer's ``step()``: the point where a training loop, Lightning or the
Hugging Face Trainer next overwrites parameters and optimizer state. ``save()`` itself never
waits. A copy that fails does not raise here: the save's future carries the failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import weakref
from typing import Any

__all__ = ["StagedWaiter"]


def _pre_step(ref: weakref.ref, optimizer: Any, args: Any, kwargs: Any) -> None:
    waiter = ref()
    if waiter is not None:
        waiter.wait()


class StagedWaiter:
    """The un-staged saves of one saver, awaited before every optimizer step while open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[cf.Future] = set()
        self._handle: Any = None
        self.waits = 0  # times a pre-step hook found a save still staging (tests, stats)

    def add(self, staged: cf.Future) -> None:
        """Wait for ``staged`` before the next optimizer step (installs the hook on first use)."""
        if staged.done():
            return
        with self._lock:
            self._pending.add(staged)
            if self._handle is None:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                self._handle = register_optimizer_step_pre_hook(functools.partial(_pre_step, weakref.ref(self)))
        staged.add_done_callback(self._discard)

    def _discard(self, staged: cf.Future) -> None:
        with self._lock:
            self._pending.discard(staged)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every save added so far is staged (or failed); whether all are, by ``timeout``."""
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return True
        self.waits += 1
        return not cf.wait(pending, timeout).not_done

    def close(self) -> None:
        """Remove the hook (pending copies still complete; nothing waits for them at steps)."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: torch may be gone already
            pass
