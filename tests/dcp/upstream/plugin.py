"""pytest plugin for the run of PyTorch's own DCP test files against tierckpt (``-p
tests.dcp.upstream.plugin``; the storage swap itself happens at interpreter start-up, see
site/sitecustomize.py). At collection it skips, with the reason, what cannot run here and would
otherwise spend ~30 s each spawning ranks only for them to skip:

* a test wrapped by torch's ``skip_if_lt_x_gpu(n)``: the same condition that wrapper checks in
  every spawned rank, checked once here, with its message ("Need at least n CUDA devices");
* a test using an API the installed torch lacks (:data:`NEWER_TORCH`): "needs a newer torch".

Nothing else is changed: the test bodies and assertions run as PyTorch wrote them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest


def _has_allow_unsafe_types() -> bool:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return "allow_unsafe_types" in inspect.signature(DefaultLoadPlanner.__init__).parameters


# A word in a test's source -> whether the installed torch has that API, and what it is.
NEWER_TORCH: dict[str, tuple[Callable[[], bool], str]] = {
    "allow_unsafe_types": (_has_allow_unsafe_types, "DefaultLoadPlanner(allow_unsafe_types=...)"),
}


def _chain(fn: Any) -> list[Any]:
    out = []
    while fn is not None and len(out) < 32:
        out.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return out


def gpu_skip(fn: Any) -> str | None:
    """The message ``skip_if_lt_x_gpu`` would skip ``fn`` with on this machine, else None."""
    import torch
    from torch.testing._internal import common_distributed as cd

    for f in _chain(fn):
        code = getattr(f, "__code__", None)
        if code is None or not code.co_qualname.startswith("skip_if_lt_x_gpu.<locals>"):
            continue
        free = inspect.getclosurevars(f).nonlocals
        x, allow_cpu = free.get("x"), free.get("allow_cpu", False)
        if not isinstance(x, int):
            continue
        if torch.cuda.is_available() and torch.cuda.device_count() >= x:
            return None
        if getattr(cd, "TEST_HPU", False) or getattr(cd, "TEST_XPU", False):
            return None  # the wrapper counts those devices in the ranks
        if allow_cpu and not torch.cuda.is_available():
            return None
        return str(cd.TEST_SKIPS[f"multi-gpu-{x}"].message)
    return None


def newer_torch(fn: Any) -> str | None:
    try:
        src = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None
    for word, (present, what) in NEWER_TORCH.items():
        if word in src and not present():
            return f"needs a newer torch: {what} is not in torch {_torch_version()}"
    return None


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fn = getattr(item, "function", None) or getattr(item, "obj", None)
        if fn is None:
            continue
        why = gpu_skip(fn) or newer_torch(fn)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
