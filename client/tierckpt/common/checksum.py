"""The one shard checksum of tierckpt: xxh3-64, rendered as 16 lowercase hex digits.

Computed once when a shard is staged and verified at every hop (peer receive, object-store
download, restore). ``xxhash`` releases the GIL on large inputs, so hashing runs in parallel
with other threads.
"""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3-64"
_CHUNK = 64 << 20


def new():
    """An incremental hasher with ``update(bytes-like)`` and ``hexdigest()``."""
    return xxhash.xxh3_64()


def digest(buf) -> str:
    """Checksum of one contiguous bytes-like object (hashed in chunks to bound latency per call)."""
    mv = memoryview(buf).cast("B")
    h = xxhash.xxh3_64()
    for off in range(0, len(mv), _CHUNK):
        h.update(mv[off : off + _CHUNK])
    return h.hexdigest()
