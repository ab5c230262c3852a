"""A peer's first copy of a rank lands in pages allocated while the owner's trainer was still
saving (WarmReplica, tierckptd.peer.hints): real daemons, real tmpfs files."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

from ..harness import Cluster, wait_until

MIB = 1 << 20
SIZE = 24 * MIB


def _warm_files(d, size: int) -> list[Path]:
    """Untaken pool files of ``size`` bytes on daemon ``d`` whose pages are allocated."""
    pool = d.local_dir / "recycle"
    return [p for p in pool.glob(f"{size}.*") if os.stat(p).st_blocks * 512 >= size] if pool.is_dir() else []


def _slow_commits(delay: float) -> tuple[str, ...]:
    # The owner holds each commit (files in place, manifest not yet) for ``delay`` seconds: the
    # window in which the hint must already have been served. Hints are on for any filesystem;
    # the pool top-up from committed steps is off, so every warm file seen comes from a hint.
    return ("--knobs", f"debug_commit_delay={delay},warm_hint=2,warm_pool=0,warm_chunk={MIB}")


def test_a_first_copy_takes_pages_warmed_from_the_owners_hint(daemon_factory) -> None:
    cl = Cluster(daemon_factory, 2, extra=_slow_commits(2.0))
    n0, n1 = cl.d["n0"], cl.d["n1"]
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    with n0.client() as c:
        fut = c.save("job", 1, 0, 1, {"w": data, "tiny": b"x"})
        # Before the owner has even committed, the peer holds an allocated pool file of the size.
        wait_until(lambda: _warm_files(n1, SIZE), 1.8, "a warm pool file of the shard's size on n1")
        assert fut.wait("peer", timeout=30) == ["n1"]
        # The copy took it (the pool is empty again) and is byte-exact.
        assert not list((n1.local_dir / "recycle").glob(f"{SIZE}.*"))
        with n1.client() as c1:
            assert bytes(c1.restore("job", 0, 1).shards["w"]) == data.tobytes()
        # Later rounds recycle the evicted copy's files: no second hint, nothing warmed ahead.
        fut = c.save("job", 2, 0, 1, {"w": data, "tiny": b"y"})
        fut.result()
        assert not _warm_files(n1, SIZE)
        assert fut.wait("peer", timeout=30) == ["n1"]


def test_the_hint_is_refused_from_a_node_whose_placement_excludes_the_receiver(daemon_factory) -> None:
    # R=1: a receiver accepts copies (and hints) from owners up to R + 1 = 2 places before it on
    # the ring: n3 from n1 and n2, never from n0.
    cl = Cluster(daemon_factory, 4, extra=("--knobs", "warm_hint=2"))
    with grpc.insecure_channel(f"127.0.0.1:{cl.ports['n3']}") as ch:
        stub = ppb_grpc.PeerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.WarmReplica(ppb.WarmReplicaRequest(sender="n0", job="job", rank=0, sizes=[SIZE]), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "sender" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.WarmReplica(ppb.WarmReplicaRequest(sender="n2", job="../x", rank=0, sizes=[SIZE]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job" in err.value.details()
        # From an owner it serves: accepted within free capacity; an absurd size is not warmed.
        resp = stub.WarmReplica(ppb.WarmReplicaRequest(sender="n2", job="job", rank=0, sizes=[SIZE, 1 << 62]),
                                timeout=5)
        assert resp.bytes == SIZE
    wait_until(lambda: _warm_files(cl.d["n3"], SIZE), 10, "the hinted pool file on n3")
