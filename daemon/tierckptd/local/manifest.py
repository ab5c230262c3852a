"""The per-rank manifest: the commit marker of every tier.

A manifest lists one rank's shards of one step (name, size, checksum, dtype/shape, data file),
the world size, the owning node, the job's owner (the tenant or client identity that saved it:
"" is the default tenant, and the field is then left out) and user metadata, and its MAC when the cluster has a manifest
key (:mod:`.signing`: a forged or edited manifest is data loss). It is written last, by rename (local and peer
tiers) or uploaded after every shard (persistent tier); readers ignore data without one.
Manifests also arrive from peers and the object store, so parsing validates every field,
including that a shard's dtype and shape account for exactly its size (:func:`.staging.check_layout`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from tierckpt.common import checksum as _checksum
from tierckpt.common.names import (
    check_job,
    check_node,
    check_owner,
    check_rank,
    check_shard,
    check_size,
    check_step,
)
from tierckpt.errors import DataLossError, InvalidArgumentError

from . import signing
from .staging import check_layout

__all__ = ["FORMAT", "ShardEntry", "Manifest", "MANIFEST_NAME", "unsigned_note"]

FORMAT = 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class ShardEntry:
    name: str
    size: int
    checksum: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    file: str = ""  # data file name inside the rank directory (local/peer tiers)
    codec: str = ""  # persistent tier: the codec the object is stored with ("" = identity; omitted in JSON)
    chunks: tuple[tuple[str, int, int], ...] = ()  # persistent tier, content layout: (xxh3-128 hex of the
    # plain bytes, plain size, stored size) of each chunk in order (omitted in JSON when empty)


@dataclass(frozen=True)
class Manifest:
    job: str
    step: int
    rank: int
    world_size: int
    node: str  # node that owns (saved) this rank
    generation: str  # id of the save that produced it; distinguishes re-saves of one step
    shards: tuple[ShardEntry, ...]
    metadata_json: str = "{}"
    created: float = field(default_factory=time.time)
    persist: bool = False
    job_owner: str = ""  # who saved it: a tenant or client certificate name ("" = the default tenant)
    # Read without a MAC while this node signs (accept_unsigned_manifests); never written (to_json signs).
    unsigned: bool = field(default=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job, self.step, self.rank)

    def shard(self, name: str) -> ShardEntry:
        return self._by_name[name]

    @cached_property
    def stored_bytes(self) -> int:
        """Size of the manifest as stored (its JSON, metadata included): charged against the
        local capacity like a file (computed once per manifest)."""
        return len(self.to_json())

    @cached_property
    def _by_name(self) -> dict[str, ShardEntry]:
        # Built once per manifest: a rank may hold thousands of shards, and every commit,
        # restore and eviction looks each one up.
        return {s.name: s for s in self.shards}

    def to_json(self) -> bytes:
        """The manifest as canonical JSON, with its MAC when this process has a manifest key
        (:mod:`.signing`)."""
        doc: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "unsigned"}
        if not self.job_owner:  # the default tenant: manifests stay byte for byte those written before owners
            del doc["job_owner"]
        doc["format"] = FORMAT
        doc["checksum_algorithm"] = _checksum.ALGORITHM
        doc["shards"] = [_shard_doc(s) for s in self.shards]
        body = _canonical(doc)
        key = signing.active()
        if not key.signing:
            return body
        doc[signing.MAC_FIELD] = key.mac(body)
        return _canonical(doc)

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse and validate a manifest, and check its MAC (:mod:`.signing`). Raises
        DataLossError if it is malformed, forged or edited (or unsigned where that is refused)."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or not isinstance(doc.get("shards"), list):
                raise ValueError("a manifest is a JSON object with a list of shards")
            key = signing.active()
            unsigned = not key.check(doc.pop(signing.MAC_FIELD, None), _canonical(doc)) and key.signing
            if doc.get("format") != FORMAT or doc.get("checksum_algorithm") != _checksum.ALGORITHM:
                raise ValueError("unsupported manifest format or checksum algorithm")
            shards = []
            for s in doc["shards"]:
                if not isinstance(s, dict):
                    raise ValueError("manifest.shards: each shard is a JSON object")
                name = check_shard(s["name"], "manifest.shards.name")
                size = check_size(s["size"], "manifest.shards.size")
                dtype, shape = check_layout(name, size, s.get("dtype", ""), list(s.get("shape", [])))
                shards.append(ShardEntry(name=name, size=size, checksum=_check_hex(s["checksum"]), dtype=dtype,
                                         shape=shape, file=_check_file(s.get("file", "")),
                                         codec=_check_codec(s.get("codec", "")),
                                         chunks=_check_chunks(s.get("chunks", []), size)))
            rank, world = check_rank(doc["rank"], doc["world_size"])
            meta = doc.get("metadata_json", "{}")
            if not isinstance(meta, str):
                raise ValueError("metadata_json must be a string")
            return cls(
                job=check_job(doc["job"], "manifest.job"),
                step=check_step(doc["step"], "manifest.step"),
                rank=rank,
                world_size=world,
                node=check_node(doc["node"], "manifest.node"),
                generation=str(doc["generation"]),
                shards=tuple(shards),
                metadata_json=meta,
                created=float(doc.get("created", 0.0)),
                persist=bool(doc.get("persist", False)),
                job_owner=check_owner(doc.get("job_owner", ""), "manifest.job_owner"),
                unsigned=unsigned,
            )
        except (ValueError, KeyError, TypeError, AttributeError, InvalidArgumentError) as e:
            raise DataLossError(f"malformed manifest: {e}") from e
        except RecursionError:
            raise DataLossError("malformed manifest: nested too deeply") from None


def unsigned_note(man: Manifest, detail: str = "") -> str:
    """``detail`` of a ``verify`` check, saying so when the copy's manifest carries no MAC."""
    if not man.unsigned:
        return detail
    return (f"{detail}; " if detail else "") + "unsigned manifest (read only under accept_unsigned_manifests)"


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _shard_doc(s: ShardEntry) -> dict[str, Any]:
    doc = {f.name: getattr(s, f.name) for f in fields(s)}
    doc["shape"] = list(s.shape)
    if not s.codec:  # the identity: manifests stay byte for byte those written before codecs
        del doc["codec"]
    if s.chunks:
        doc["chunks"] = [list(c) for c in s.chunks]
    else:
        del doc["chunks"]
    return doc


def _check_chunks(value: Any, size: int) -> tuple[tuple[str, int, int], ...]:
    if not isinstance(value, list):
        raise ValueError("manifest.shards.chunks must be a list")
    out = []
    for c in value:
        if (not isinstance(c, list) or len(c) != 3 or not isinstance(c[0], str)
                or not re.fullmatch(r"[0-9a-f]{32}", c[0])):
            raise ValueError(f"manifest.shards.chunks: {c!r} is not [xxh3-128 hex, size, stored size]")
        out.append((c[0], check_size(c[1], "manifest.shards.chunks.size"),
                    check_size(c[2], "manifest.shards.chunks.stored")))
    if out and sum(c[1] for c in out) != size:
        raise ValueError("manifest.shards.chunks do not add up to the shard's size")
    return tuple(out)


def _check_codec(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[a-z0-9-]{0,64}", value):
        raise ValueError(f"codec {value!r} is not a codec name")
    return value


def _check_hex(value: Any) -> str:
    if not isinstance(value, str) or len(value) != 16 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"checksum {value!r} is not 16 lowercase hex digits")
    return value


def _check_file(value: Any) -> str:
    if value == "":
        return value
    return check_shard(value, "manifest.shards.file")
