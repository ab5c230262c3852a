"""The persistent tier: drain selected steps to an object store, restore from it.

One concept per module:

- :mod:`.layout`: object keys (chunks or data objects, manifests as commit markers).
- :mod:`.content`: the content layout's chunks (deduplicated upload, decoded download); :mod:`.gc`
  collects the chunks no manifest names.
- :mod:`.selection`: which ranks are drained; which steps retention removes (pure).
- :mod:`.queue`: the durable drain queue (one JSON file per pending rank), written off the loop.
- :mod:`.ledger`: pending, drained and failed ranks of this process (in memory).
- :mod:`.calls`: object-store calls off the event loop, with retries, on the tier's own threads.
- :mod:`.codec`: the transform seam each shard's bytes pass through (identity by default).
- :mod:`.uploader`: draining one rank (shards, manifest last, stale-object cleanup).
- :mod:`.drainer`: the drain loop (order, concurrency, outcomes, unpinning).
- :mod:`.takeover`: draining the selected copies of lost owners.
- :mod:`.retention`: ``keep_persistent``.
- :mod:`.tombstone`: a deleted step stays deleted (``tierckpt rm`` against drains in flight).
- :mod:`.catalog`: the per-job catalog cache and manifest reads.
- :mod:`.download`: fetching a rank into the local store, verified.
- :mod:`.audit`: re-hashing stored objects (``tierckpt verify``).
- :mod:`.tier`: :class:`PersistentTier`, the :class:`~tierckptd.tiers.RemoteTier` facade.

Each module's docstring states its part of the contract (selection, layout, queue, retries,
take-over, retention, restore).
"""

from .codec import IDENTITY, ShardCodec, codec_named, register_codec
from .layout import data_key, manifest_key, object_keys, parse_manifest_key
from .queue import DrainQueue
from .selection import not_selected_reason, plan_retention, selected
from .tier import PersistentTier

__all__ = [
    "PersistentTier", "DrainQueue", "selected", "not_selected_reason", "plan_retention",
    "manifest_key", "data_key", "object_keys", "parse_manifest_key",
    "ShardCodec", "IDENTITY", "register_codec", "codec_named",
]
