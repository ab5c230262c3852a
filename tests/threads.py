"""Threads whose checks report back.

An exception raised in a plain ``threading.Thread`` is printed and lost: a test that asserts in a
thread, or waits on work done in one, passes whether or not the thread's checks held (or ran).
:class:`Checked` keeps what its target returned or raised and hands it back in ``join``, which
also fails when the thread did not finish in time (or was never started).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Checked", "join_all"]


class Checked(threading.Thread):
    """``Checked(fn, *args, **kwargs)``: run ``fn`` in a daemon thread; ``join()`` returns its result
    or re-raises its exception, and raises AssertionError if it is still running after ``timeout``."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(name=name or getattr(fn, "__name__", None), daemon=True)
        self._fn, self._fn_args, self._fn_kwargs = fn, args, kwargs
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False

    def run(self) -> None:
        try:
            self.result = self._fn(*self._fn_args, **self._fn_kwargs)
        except BaseException as e:  # handed back by join()
            self.error = e
        finally:
            self.finished = True

    def join(self, timeout: float | None = 60.0) -> Any:
        super().join(timeout)
        if self.is_alive() or not self.finished:
            raise AssertionError(f"thread {self.name!r} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


def join_all(threads: list[Checked], timeout: float = 60.0) -> list[Any]:
    """Join every thread (all of them, even when one failed); re-raise the first failure."""
    results: list[Any] = []
    first: BaseException | None = None
    for t in threads:
        try:
            results.append(t.join(timeout))
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first
    return results
