"""An in-process persistent tier for unit tests: a LocalStore on a tmp dir, a PersistentTier over
a MemoryBackend (wrapped in a FaultyBackend), a fake ClusterView and a host that records what the
tier announced. No subprocess, no server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt.common import checksum
from tierckptd.cluster import Key
from tierckptd.config import DaemonConfig
from tierckptd.fakes import FaultyBackend, MemoryBackend
from tierckptd.local.manifest import Manifest
from tierckptd.local.staging import dtype_itemsize
from tierckptd.local.store import LocalStore
from tierckptd.persistent import PersistentTier

URL = "memory://test/"


class FakeCluster:
    """A ClusterView whose answers the test sets: ``down[node] = seconds``, ``holders[key] = [...]``."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.down: dict[str, float] = {}
        self.holders: dict[Key, list[str]] = {}

    def is_up(self, node_id: str) -> bool:
        return node_id not in self.down

    def down_for(self, node_id: str) -> float:
        return self.down.get(node_id, 0.0)

    def live_holders(self, key: Key, generation: str) -> list[str]:
        return sorted(n for n in self.holders.get(key, []) if self.is_up(n))


class Host:
    def __init__(self) -> None:
        self.ingested: list[Manifest] = []
        self.repairs: list[Manifest] = []

    def notify_ingested(self, manifest: Manifest) -> None:
        self.ingested.append(manifest)

    async def repair_local(self, manifest: Manifest) -> bool:
        self.repairs.append(manifest)
        return False  # no peer tier here: nothing to repair from


class Rig:
    """One node: ``store``, ``tier``, ``faulty`` (wrapping ``memory``), ``cluster``, ``host``;
    ``layout`` is the ``persistent_layout`` its drains write (both are read)."""

    def __init__(self, root: Path, *, node_id: str = "n0", persist_every: int = 1, keep_persistent: int = 0,
                 cluster: FakeCluster | None = None, memory: MemoryBackend | None = None,
                 store: LocalStore | None = None, layout: str = "content", **tier_kw: Any) -> None:
        self.root = root
        self.node_id = node_id
        if store is None:
            store = LocalStore(root / f"{node_id}-local", node_id, fsync="never")
            store.open()
        self.store = store
        # the same objects, opened again (a stopped tier closes its backend)
        self.memory = MemoryBackend(URL, objects=memory.objects if memory else None)
        self.faulty = FaultyBackend(self.memory)
        self.cluster = cluster
        self.host = Host()
        self.config = DaemonConfig(node_id=node_id, local_dir=str(store.root), persistent=URL,
                                   persist_every=persist_every, keep_persistent=keep_persistent,
                                   persistent_layout=layout)
        self.tier = PersistentTier(self.config, store, cluster=cluster, backend=self.faulty, **tier_kw)
        self.tier.bind(self.host)

    def save(self, job: str, step: int, rank: int, shards: dict[str, bytes], *, world: int = 1,
             persist: bool = False, node: str | None = None, generation: str | None = None,
             dtypes: dict[str, str] | None = None) -> Manifest:
        """Commit a rank into the local store and tell the tier, as the node does. ``node``
        other than this node makes it a replica (ingested) of that owner's rank; ``dtypes``
        names a shard's dtype (default none)."""
        dt = dtypes or {}
        shape = {n: (len(b) // dtype_itemsize(dt[n]),) for n, b in shards.items() if dt.get(n)}
        st = self.store.begin(job, step, rank, world, [(n, len(b), dt.get(n, ""), shape.get(n, ()))
                                                       for n, b in shards.items()])
        for name, data in shards.items():
            st.files[name].path.write_bytes(data)
        replica = node is not None and node != self.node_id
        pin = None if replica else self.tier.commit_pin(job, step, persist)
        man, _ = self.store.commit(st.save_id, {n: checksum.digest(b) for n, b in shards.items()},
                                   persist=persist, node=node, generation=generation, pin=pin)
        self.tier.on_commit(man, ingested=replica)
        return man

    def queue_files(self) -> list[str]:
        return sorted(p.name for p in self.tier.queue.root.iterdir())


async def until(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``predicate`` on the loop (each look is instant; no grace period is slept through)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
    return value
