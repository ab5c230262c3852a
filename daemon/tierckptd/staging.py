"""Open saves of the local tier: what BeginSave reserved, and the validation of its shard specs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tierckpt.common.names import MAX_SHARDS_PER_RANK, check_shard, check_size
from tierckpt.errors import InvalidArgumentError

__all__ = ["StagedFile", "Staging", "ShardSpec", "check_specs"]

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
    written: int = 0  # bytes received through write_chunk (stream transfers)


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

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())


def check_specs(specs: Sequence[ShardSpec], max_shard_bytes: int) -> None:
    """Validate one rank's shard specs (names, sizes, count, duplicates).

    Raises:
        InvalidArgumentError: the message names the field.
    """
    if not specs:
        raise InvalidArgumentError("shards: at least one shard is required")
    if len(specs) > MAX_SHARDS_PER_RANK:
        raise InvalidArgumentError(f"shards: at most {MAX_SHARDS_PER_RANK} shards per rank")
    names: set[str] = set()
    for name, size, _dtype, _shape in specs:
        check_shard(name, "shards.name")
        check_size(size, f"shards[{name}].size", max_shard_bytes)
        if name in names:
            raise InvalidArgumentError(f"shards.name: {name!r} appears twice")
        names.add(name)
