"""Turning user buffers into contiguous byte views, and stored bytes back into arrays.

Accepted: bytes, bytearray, memoryview, numpy arrays, and torch CPU tensors (when torch is
installed; GPU tensors are copied to host memory first). The dtype string recorded in the
manifest is numpy's (``"<f4"``) or ``"torch:<name>"`` for torch tensors, so restore can give
back a tensor of the same dtype even where numpy has none (bfloat16, float8).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["ShardBuffer", "as_buffer", "to_array", "torch_dtype_numpy"]

_TORCH_PREFIX = "torch:"


@dataclass(frozen=True)
class ShardBuffer:
    name: str
    view: memoryview  # contiguous, format "B"
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_buffer(name: str, obj: Any) -> ShardBuffer:
    """A contiguous byte view of ``obj`` without copying where possible."""
    if _is_torch_tensor(obj):
        t = obj.detach() if obj.requires_grad else obj
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        shape = tuple(t.shape)
        dtype = _TORCH_PREFIX + str(t.dtype).removeprefix("torch.")
        if not t.numel():
            return ShardBuffer(name, memoryview(b""), dtype, shape)
        try:  # the cheap way (a few microseconds count when a save has thousands of tensors)
            raw = t.numpy().reshape(-1).view(np.uint8)
        except (TypeError, RuntimeError):  # no numpy twin (bfloat16, float8...): through a uint8 view
            raw = t.reshape(-1).view(sys.modules["torch"].uint8).numpy()
        return ShardBuffer(name, memoryview(raw), dtype, shape)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise InvalidArgumentError(f"shards[{name}]: numpy object arrays cannot be saved (dtype {obj.dtype})")
        arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # ascontiguousarray makes 0-d 1-d
        flat: Any = arr.reshape(-1).view(np.uint8)
        return ShardBuffer(name, memoryview(flat) if arr.size else memoryview(b""), arr.dtype.str, tuple(arr.shape))
    if isinstance(obj, (bytes, bytearray, memoryview)):
        mv = memoryview(obj)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        return ShardBuffer(name, mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, "", ())
    raise InvalidArgumentError(
        f"shards[{name}]: unsupported type {type(obj).__name__} (use bytes, bytearray, memoryview, "
        "a numpy array or a torch tensor)"
    )


def torch_dtype_numpy(dtype: str) -> np.dtype | None:
    """numpy equivalent of a recorded torch dtype, or None (bfloat16, float8...)."""
    name = dtype.removeprefix(_TORCH_PREFIX)
    try:
        return np.dtype({"bool": "?", "complex64": "c8", "complex128": "c16"}.get(name, name))
    except TypeError:
        return None


def to_array(buf: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of stored bytes: typed where numpy knows the dtype, else flat uint8."""
    raw = np.frombuffer(buf, dtype=np.uint8) if memoryview(buf) else np.empty(0, np.uint8)
    if not dtype:
        return raw
    npdt = torch_dtype_numpy(dtype) if dtype.startswith(_TORCH_PREFIX) else np.dtype(dtype)
    if npdt is None:
        return raw
    arr = raw.view(npdt) if raw.size else np.empty(0, npdt)
    return arr.reshape(shape)


def to_tensor(buf: Any, dtype: str, shape: tuple[int, ...]):
    """A torch tensor over stored bytes (shares memory; read-only buffers warn in torch, so copy-free
    use is up to the caller)."""
    import torch

    raw = np.frombuffer(buf, dtype=np.uint8) if memoryview(buf) else np.empty(0, np.uint8)
    if dtype.startswith(_TORCH_PREFIX):
        tdt = getattr(torch, dtype.removeprefix(_TORCH_PREFIX))
    elif dtype:
        tdt = torch.from_numpy(np.empty(0, np.dtype(dtype))).dtype
    else:
        tdt = torch.uint8
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable buffer: the caller must not write
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw.size else torch.empty(0, dtype=torch.uint8)
    return t.view(tdt).reshape(shape) if dtype else t
