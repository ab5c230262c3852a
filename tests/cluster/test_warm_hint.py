"""A peer's first copy of a rank lands in pages allocated while the owner's trainer was still
saving (WarmReplica, tierckptd.peer.hints): real daemons, real tmpfs files."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest
from tierckpt.common import checksum
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import peer_pb2_grpc as ppb_grpc
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

from ..harness import Cluster, wait_until

MIB = 1 << 20
SIZE = 24 * MIB


def _warm_files(d, size: int) -> list[Path]:
    """Untaken pool files of ``size`` bytes on daemon ``d`` whose pages are allocated."""
    pool = d.local_dir / "recycle"
    return [p for p in pool.glob(f"{size}.*") if os.stat(p).st_blocks * 512 >= size] if pool.is_dir() else []


def _files_of_size(d, size: int) -> dict[int, Path]:
    """The committed files of ``size`` bytes on daemon ``d`` by inode (not in the pool or staging)."""
    return {p.stat().st_ino: p for p in d.local_dir.rglob("*")
            if p.is_file() and p.stat().st_size == size and not {"recycle", "staging"} & set(p.parts)}


def _hints_logged(d) -> int:
    """WarmReplica hints that owner ``d`` sent to n1 and n1 took (logged at DEBUG)."""
    return d.log_path.read_text(errors="replace").count("warm hint for job rank 0 to n1:")


class _HeldSave:
    """A save of rank 0 of ``job`` begun on a daemon and written, its commit held until :meth:`commit`:
    the window between the owner's BeginSave (when the hint goes out) and its copy, as long as a
    test needs it (a loaded machine warms at the lowest CPU priority, and may take seconds)."""

    def __init__(self, d, step: int, shards: dict[str, bytes]) -> None:
        self.channel = grpc.insecure_channel(d.address)
        self.stub = pb_grpc.TierckptStub(self.channel)
        self.step, self.shards = step, shards
        resp = self.stub.BeginSave(pb.BeginSaveRequest(
            job="job", step=step, rank=0, world_size=1, transfer=pb.TRANSFER_SHARED_FS,
            shards=[pb.ShardSpec(name=n, size=len(b)) for n, b in shards.items()]), timeout=30)
        for f in resp.shards:
            with open(f.path, "r+b") as fh:
                fh.write(shards[f.name])
        self.save_id = resp.save_id

    def commit(self) -> list[str]:
        """Commit; return the nodes holding the peer copy once it is there."""
        digests = [pb.ShardDigest(name=n, checksum=checksum.digest(b)) for n, b in self.shards.items()]
        self.stub.CommitSave(pb.CommitSaveRequest(save_id=self.save_id, digests=digests, metadata_json="{}"),
                             timeout=60)
        resp = self.stub.WaitTier(pb.WaitTierRequest(job="job", step=self.step, rank=0, tier=pb.TIER_PEER,
                                                     timeout_seconds=60), timeout=90)
        self.channel.close()
        return list(resp.nodes)


def test_a_first_copy_takes_pages_warmed_from_the_owners_hint(daemon_factory) -> None:
    # Hints are on for any filesystem; the pool top-up from committed steps is off, so every
    # warm file seen comes from a hint. DEBUG: the owner logs each hint that a peer took.
    # A generous hint deadline: the default (2 s) is for production, where a late hint is only lost.
    knobs = f"warm_hint=2,warm_pool=0,warm_chunk={MIB},warm_hint_timeout=30"
    cl = Cluster(daemon_factory, 2, extra=("--knobs", knobs, "--log-level", "DEBUG"))
    n0, n1 = cl.d["n0"], cl.d["n1"]
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    held = _HeldSave(n0, 1, {"w": data, "tiny": b"x"})
    # Before the owner has even committed, the peer holds an allocated pool file of the size
    # (nothing takes it until the commit: no window to catch).
    (warm,) = wait_until(lambda: _warm_files(n1, SIZE), 60, "a warm pool file of the shard's size on n1")
    ino = warm.stat().st_ino
    assert held.commit() == ["n1"]
    # The copy took it: the pool is empty again, and n1's copy of the shard is that very file.
    assert not list((n1.local_dir / "recycle").glob(f"{SIZE}.*"))
    assert ino in _files_of_size(n1, SIZE), "n1's copy did not take the warmed pool file"
    with n1.client() as c1:
        assert bytes(c1.restore("job", 0, 1).shards["w"]) == data
    wait_until(lambda: _hints_logged(n0) == 1, 30, "the owner's log of the hint n1 took")
    # Later rounds recycle the evicted copy's files: no second hint, nothing warmed ahead.
    assert _HeldSave(n0, 2, {"w": data, "tiny": b"y"}).commit() == ["n1"]
    assert not _warm_files(n1, SIZE)
    assert _hints_logged(n0) == 1


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
    wait_until(lambda: _warm_files(cl.d["n3"], SIZE), 60, "the hinted pool file on n3")
