"""Open saves of the local tier: what BeginSave reserved, and the validation of its shard specs."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt.common.names import (
    MAX_SHARD_NAME,
    MAX_SHARDS_PER_RANK,
    NAME_MAX,
    NAME_SUFFIX_MAX,
    check_size,
    check_stored_shard,
)
from tierckpt.errors import InvalidArgumentError

__all__ = ["StagedFile", "Staging", "ShardSpec", "check_specs", "check_layout", "dtype_itemsize",
           "NAME_MAX", "NAME_SUFFIX_MAX", "MAX_SHARD_NAME"]

MAX_DIMS = 64  # numpy's limit

# Bytes per element of the torch dtypes the client records as "torch:<name>" (see
# tierckpt._buffers): torch has no dtype string numpy parses for these.
_TORCH_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}

ShardSpec = tuple[str, int, str, Sequence[int]]
"""(name, size, dtype, shape) of one shard, as BeginSave declares it."""


@dataclass
class StagedFile:
    name: str
    size: int
    path: Path
    dtype: str = ""
    shape: tuple[int, ...] = ()
    recycled: bool = False
    warm: bool = False  # recycled from a warm pool file: allocated, never written (not faulted in)
    reserved: bool = False  # a whole reserve file of at least its size (touched: faulted in), see .reserve
    written: int = 0  # bytes received through write_chunk (stream transfers)
    shared: bool = False  # a link to a committed file with the same bytes (nothing is written)
    ino: tuple[int, int] | None = None  # shared: (st_dev, st_ino) of the linked file
    checksum: str = ""  # shared: the committed file's checksum


@dataclass
class Staging:
    """One open save: reserved capacity and staging files for one rank of one step."""

    save_id: str
    job: str
    step: int
    rank: int
    world_size: int
    files: dict[str, StagedFile]
    dir: Path
    stream: bool
    created: float = field(default_factory=time.monotonic)
    begun_wall: float = field(default_factory=time.time)
    evictable: Callable[[str], bool] | None = None  # jobs whose steps this reservation may evict (None: any)
    inbound: bool = False  # written by this daemon (peer copy, restore fetch), not by a local trainer
    job_owner: str = ""  # the identity the copy is saved for (its manifest's job_owner)
    manifest_bytes: int = 0  # size of the manifest its commit writes (charged from then on; 0: not known yet)
    grant: Any = None  # what it took from the reserve (a .reserve.Grant), until its files are created

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def new_bytes(self) -> int:
        """Bytes of the files this save stages anew (not the shared ones)."""
        return sum(f.size for f in self.files.values() if not f.shared)


def check_specs(specs: Sequence[ShardSpec], max_shard_bytes: int, max_shards: int = MAX_SHARDS_PER_RANK) -> None:
    """Validate one rank's shard specs (names, sizes, count, duplicates); at most ``max_shards``
    (the daemon's ``max_shards_per_save``).

    Raises:
        InvalidArgumentError: the message names the field.
    """
    if not specs:
        raise InvalidArgumentError("shards: at least one shard is required")
    if len(specs) > min(max_shards, MAX_SHARDS_PER_RANK):
        raise InvalidArgumentError(f"shards: {len(specs)} shards in one save exceed max_shards_per_save "
                                   f"({min(max_shards, MAX_SHARDS_PER_RANK)})")
    names: set[str] = set()
    for name, size, dtype, shape in specs:
        check_stored_shard(name, "shards.name")
        check_size(size, f"shards[{name}].size", max_shard_bytes)
        check_layout(name, size, dtype, shape)
        if name in names:
            raise InvalidArgumentError(f"shards.name: {name!r} appears twice")
        names.add(name)


def dtype_itemsize(dtype: object, field: str = "shards.dtype") -> int:
    """Bytes per element of a dtype string as the client records it: numpy's canonical
    ``dtype.str`` (``"<f4"``, ``"|b1"``, ``"<U5"``) or ``"torch:<name>"``.

    Raises:
        InvalidArgumentError: not a known dtype string (the message names ``field``).
    """
    if not isinstance(dtype, str) or not dtype or len(dtype) > 32:
        raise InvalidArgumentError(f"{field}: {str(dtype)[:40]!r} is not a known dtype")
    if dtype.startswith("torch:"):
        size = _TORCH_ITEMSIZE.get(dtype[6:])
        if size is None:
            raise InvalidArgumentError(f"{field}: {dtype!r} is not a known torch dtype")
        return size
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError):
        raise InvalidArgumentError(f"{field}: {dtype!r} is not a numpy dtype string") from None
    if dt.str != dtype or dt.hasobject:
        raise InvalidArgumentError(f"{field}: {dtype!r} is not a canonical numpy dtype string (such as '<f4')")
    return dt.itemsize


def check_layout(name: str, size: int, dtype: object, shape: object) -> tuple[str, tuple[int, ...]]:
    """Check a shard's dtype and shape against its byte size.

    An empty dtype means raw bytes (then the shape must be empty). With a dtype, the shape is
    its dimensions (empty: a 0-d array) and ``prod(shape) * itemsize`` must equal ``size``.

    Raises:
        InvalidArgumentError: naming ``shards.dtype`` or ``shards.shape``.
    """
    dims = tuple(shape) if isinstance(shape, (list, tuple)) else None
    if dims is None or len(dims) > MAX_DIMS or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                                   for d in dims):
        raise InvalidArgumentError(f"shards.shape: shard {name!r}: at most {MAX_DIMS} non-negative integers")
    if dtype == "":
        if dims:
            raise InvalidArgumentError(f"shards.shape: shard {name!r} has a shape but no dtype")
        return "", ()
    itemsize = dtype_itemsize(dtype, f"shards.dtype (shard {name!r})")
    if math.prod(dims) * itemsize != size:
        raise InvalidArgumentError(
            f"shards.shape: shard {name!r}: shape {list(dims)} of {dtype} is {math.prod(dims) * itemsize} bytes, "
            f"but size is {size}")
    return str(dtype), tuple(int(d) for d in dims)
