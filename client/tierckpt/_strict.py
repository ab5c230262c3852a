"""Strict restores of :class:`tierckpt.CheckpointManager`: the live state must match what is stored.

A :class:`Mismatch` collects, by key path (``model.net.0.weight``, ``opt``), the keys the state
has and the checkpoint lacks, the keys the checkpoint has and the state lacks, and the arrays or
tensors whose shape or dtype differ (expected: the state's; stored: the checkpoint's). It is
raised as one :class:`~tierckpt.errors.InvalidArgumentError` before anything is changed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["Mismatch", "check_raw", "check_torch"]

_SHOWN = 8  # names per list in the message


class Mismatch:
    """Differences between a live state and a stored one, by key path."""

    def __init__(self) -> None:
        self.missing: list[str] = []  # in the state, not in the checkpoint
        self.extra: list[str] = []  # in the checkpoint, not in the state
        self.layout: list[str] = []  # "path: expected X, stored Y"

    def keys(self, prefix: str, live: Any, stored: Any) -> list[Any]:
        """Note the keys only one side has; the keys both have."""
        self.missing += [_join(prefix, k) for k in live if k not in stored]
        self.extra += [_join(prefix, k) for k in stored if k not in live]
        return [k for k in live if k in stored]

    def compare(self, path: str, expected: str | None, stored: str | None) -> None:
        if expected is not None and stored is not None and expected != stored:
            self.layout.append(f"{path}: expected {expected}, stored {stored}")

    def raise_if_any(self, where: str) -> None:
        parts = []
        for label, names in (("missing in the checkpoint", self.missing), ("not in the state", self.extra),
                             ("layout differs", self.layout)):
            if names:
                more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
                parts.append(f"{label}: {', '.join(names[:_SHOWN])}{more}")
        if parts:
            raise InvalidArgumentError(f"state: does not match {where}: {'; '.join(parts)} "
                                       "(restore(..., strict=False) takes what matches)")


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _layout(obj: Any) -> str | None:
    """``float32[2, 3]`` for an array or tensor, ``bytes`` for bytes, else None (not compared)."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return "bytes"
    shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
    if shape is None or dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return f"{name}{list(shape)}"


def check_raw(state: Mapping[str, Any], shards: Mapping[str, Any], kinds: Mapping[str, str], where: str) -> None:
    """A raw state (names -> numpy arrays or bytes) against the stored shards."""
    m = Mismatch()
    for name in m.keys("", state, shards):
        arr = shards[name]
        m.compare(name, _layout(state[name]), "bytes" if kinds.get(name) == "bytes" else _layout(arr))
    m.raise_if_any(where)


def check_torch(state: Mapping[str, Any], stored: Mapping[str, Any], where: str) -> None:
    """A torch training state against the stored one: the top-level keys, and inside modules,
    tensors and plain mappings every key path, shape and dtype. Optimizers and other stateful
    objects are checked by their own ``load_state_dict`` (a fresh optimizer holds no state yet)."""
    torch = sys.modules["torch"]
    m = Mismatch()
    for key in m.keys("", state, stored):
        obj, saved = state[key], stored[key]
        if isinstance(obj, torch.nn.Module):
            _tree(m, str(key), obj.state_dict(), saved)
        elif isinstance(obj, torch.Tensor) or (isinstance(obj, Mapping) and not hasattr(obj, "load_state_dict")):
            _tree(m, str(key), obj, saved)
    m.raise_if_any(where)


def _tree(m: Mismatch, path: str, live: Any, saved: Any) -> None:
    if isinstance(live, Mapping) and isinstance(saved, Mapping):
        for k in m.keys(path, live, saved):
            _tree(m, _join(path, k), live[k], saved[k])
        return
    expected, got = _layout(live), _layout(saved)
    if (expected is None) != (got is None) and (isinstance(live, np.ndarray) or hasattr(live, "is_floating_point")):
        m.compare(path, expected, got or type(saved).__name__)
    else:
        m.compare(path, expected, got)
