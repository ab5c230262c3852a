"""Validation of identifiers shared by the client and the daemon (see DESIGN.md, Identity)."""

from __future__ import annotations

import re

from ..errors import InvalidArgumentError

JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SHARD_RE = re.compile(r"[A-Za-z0-9._-]{1,255}")
NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")  # Kubernetes node names are DNS names (<= 253)
OWNER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,252}")  # a tenant or a client certificate name
MAX_STEP = 2**64 - 1
MAX_WORLD_SIZE = 1 << 20
# A single shard above 1 TiB is refused as absurd; the daemon's --max-shard-bytes narrows it further.
MAX_SHARD_BYTES = 1 << 40
MAX_SHARDS_PER_RANK = 4096
NAME_MAX = 255
"""Longest file name the daemon's local dir stores (Linux NAME_MAX)."""
NAME_SUFFIX_MAX = 24
"""Longest suffix the daemon appends to a shard name in its local dir: ``.<save_id>`` on committed
data (17) and the persistent tier's download temporaries ``.tierckpt-tmp-<8 hex>`` (22), rounded up."""
MAX_SHARD_NAME = NAME_MAX - NAME_SUFFIX_MAX
MAX_METADATA_BYTES = 1 << 20


def check_job(job: object, field: str = "job") -> str:
    if not isinstance(job, str) or not JOB_RE.fullmatch(job) or ".." in job:
        raise InvalidArgumentError(
            f"{field}: {job!r} is not a valid job name (pattern [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}, no '..')"
        )
    return job


def check_shard(name: object, field: str = "shard") -> str:
    if not isinstance(name, str) or not SHARD_RE.fullmatch(name) or ".." in name or name in (".",):
        raise InvalidArgumentError(
            f"{field}: {name!r} is not a valid shard name (pattern [A-Za-z0-9._-]{{1,255}}, no '..')"
        )
    return name


def check_stored_shard(name: object, field: str = "shards.name") -> str:
    """A shard name the daemon can store: :func:`check_shard` and at most :data:`MAX_SHARD_NAME`
    bytes (checked by the client whether or not the shard is packed, so both are refused alike)."""
    check_shard(name, field)
    assert isinstance(name, str)
    if len(name.encode()) > MAX_SHARD_NAME:
        raise InvalidArgumentError(
            f"{field}: {name[:16]!r}... is {len(name)} bytes; the local dir stores names of at most "
            f"{MAX_SHARD_NAME} bytes (NAME_MAX {NAME_MAX} less the {NAME_SUFFIX_MAX}-byte suffix it appends)")
    return name


def check_node(node: object, field: str = "node_id") -> str:
    if not isinstance(node, str) or not NODE_RE.fullmatch(node) or ".." in node:
        raise InvalidArgumentError(
            f"{field}: {node!r} is not a valid node id (pattern [A-Za-z0-9][A-Za-z0-9._-]{{0,252}})")
    return node


def check_owner(owner: object, field: str = "job_owner") -> str:
    """A job owner: "" (the default tenant) or a tenant / client certificate name."""
    if owner == "":
        return owner
    if not isinstance(owner, str) or not OWNER_RE.fullmatch(owner):
        raise InvalidArgumentError(
            f"{field}: {owner!r} is not a valid owner name (pattern [A-Za-z0-9][A-Za-z0-9._@:-]{{0,252}}, or empty)")
    return owner


def check_step(step: object, field: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidArgumentError(f"{field}: {step!r} must be an integer in [0, 2**64-1]")
    return step


def check_rank(rank: object, world_size: object) -> tuple[int, int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgumentError(f"world_size: {world_size!r} must be an integer in [1, {MAX_WORLD_SIZE}]")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank: {rank!r} must be an integer in [0, world_size={world_size})")
    return rank, world_size


def check_size(size: object, field: str = "size", limit: int = MAX_SHARD_BYTES) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= limit:
        raise InvalidArgumentError(f"{field}: {size!r} must be an integer in [0, {limit}]")
    return size
