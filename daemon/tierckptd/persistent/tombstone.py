"""A deleted step stays deleted: the tombstone ``tierckpt rm`` leaves in the object store.

Deleting a step races with its drains: a rank queued or uploading on any node that owns (or took
over) a rank of it could publish its manifest after the deletion listed the step, and the step
would come back, intact, as ``latest()``. ``rm`` therefore writes a tombstone
(:func:`.layout.tombstone_key`, beside the step's manifests) *before* it deletes anything, and:

- every node cancels its queued drains of the step (the delete, or the removal of its local
  copies, tells the drainer) and waits out the attempts in flight (bounded);
- the uploader reads the tombstone before it publishes a rank's manifest (refusing a covered
  save) and again after (deleting the manifest it just wrote if the tombstone appeared meanwhile);
  either that second read or the deletion's listing, which follows the tombstone, sees the
  manifest;
- the catalog hides a manifest the tombstone covers (a daemon killed between its publish and
  its second read leaves one behind).

A tombstone covers the saves of the step that the deleting node knew (``generations``: its own
copies, its cancelled drains, the manifests it listed) and every save committed before the
deletion (``created <= deleted_at``, the committing node's clock), so a step saved again after
``rm`` (a job that resumed from an earlier step) drains and restores normally. The covered time
rule assumes the nodes' clocks agree within the time between a save and its deletion.

A tombstone is tiny and stays; ``keep_persistent`` removes it with its step. Its bytes come from
the bucket: a malformed one covers every save of the step (deleting stays the safe reading).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time

from tierckpt.errors import NotFoundError

from ..local.manifest import Manifest
from .calls import BackendCalls
from .layout import tombstone_key

__all__ = ["Tombstone", "StepDeleted", "new_tombstone", "read_tombstone", "write_tombstone", "MAX_TOMBSTONE_BYTES"]

log = logging.getLogger(__name__)

MAX_TOMBSTONE_BYTES = 1 << 20
_MAX_GENERATIONS = 16384


class StepDeleted(Exception):
    """The rank's step was deleted (``tierckpt rm``) after this save was committed: not published."""


@dataclasses.dataclass(frozen=True)
class Tombstone:
    job: str
    step: int
    deleted_at: float  # wall clock of the deleting node; inf for a malformed tombstone
    generations: frozenset[str] = frozenset()
    by: str = ""

    def covers(self, man: Manifest) -> bool:
        """Whether ``man`` is a save the deletion removed (see the module docstring)."""
        return man.generation in self.generations or man.created <= self.deleted_at

    def merged(self, other: Tombstone | None) -> Tombstone:
        """This tombstone, also covering what an earlier one of the same step covered."""
        if other is None or other.by == "malformed":  # a new deletion replaces an unreadable tombstone
            return self
        return dataclasses.replace(self, deleted_at=max(self.deleted_at, other.deleted_at),
                                   generations=self.generations | other.generations)

    def to_json(self) -> bytes:
        return json.dumps({"format": 1, "job": self.job, "step": self.step, "deleted_at": self.deleted_at,
                           "generations": sorted(self.generations)[-_MAX_GENERATIONS:], "by": self.by},
                          sort_keys=True).encode()

    @classmethod
    def parse(cls, job: str, step: int, data: bytes) -> Tombstone:
        """The tombstone of ``job`` step ``step`` in ``data``; a malformed one covers every save."""
        try:
            if len(data) > MAX_TOMBSTONE_BYTES:
                raise ValueError(f"{len(data)} bytes (at most {MAX_TOMBSTONE_BYTES})")
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("job") != job or doc.get("step") != step:
                raise ValueError("it names another step")
            at, gens, by = doc.get("deleted_at"), doc.get("generations", []), doc.get("by", "")
            if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
                raise ValueError("deleted_at is not a finite number")
            if not isinstance(gens, list) or not all(isinstance(g, str) and len(g) <= 256 for g in gens):
                raise ValueError("generations is not a list of names")
            return cls(job, step, float(at), frozenset(gens), by if isinstance(by, str) else "")
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            log.error("tombstone of %s step %d is malformed (%s): it covers every save of the step", job, step, err)
            return cls(job, step, math.inf, by="malformed")


def new_tombstone(job: str, step: int, generations: set[str], by: str) -> Tombstone:
    return Tombstone(job, step, time.time(), frozenset(generations), by)


async def read_tombstone(calls: BackendCalls, job: str, step: int) -> Tombstone | None:
    """The step's tombstone, or None.

    Raises:
        UnavailableError, BackendError: the store cannot be read.
    """
    try:
        data = await calls.read(functools.partial(calls.be.get_bytes, tombstone_key(job, step)))
    except NotFoundError:
        return None
    return Tombstone.parse(job, step, data)


async def write_tombstone(calls: BackendCalls, stone: Tombstone) -> Tombstone:
    """Store ``stone`` (merged with the step's earlier tombstone); returns what was stored.

    Raises:
        UnavailableError, BackendError: the store failed (nothing was deleted yet).
    """
    stone = stone.merged(await read_tombstone(calls, stone.job, stone.step))
    await calls.read(functools.partial(calls.be.put_bytes, tombstone_key(stone.job, stone.step), stone.to_json()))
    return stone
