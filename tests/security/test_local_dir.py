"""Attacks on the local dir through a real daemon: a trainer who can write below local_dir swaps
files or directories for symlinks. Each test asserts the refusal and that nothing outside
local_dir changed (DESIGN.md, Trust model: the local dir never follows a symlink)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest
from tierckpt.common import checksum as _checksum
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

SECRET = b"TOP-SECRET-" * 8


@pytest.fixture
def secret(scratch) -> Path:
    p = scratch / "outside" / "secret.txt"
    p.parent.mkdir()
    p.write_bytes(SECRET)
    return p


def _stub(daemon):
    return pb_grpc.TierckptStub(grpc.insecure_channel(daemon.address))


def _tree(path: Path) -> dict:
    return {str(p): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def test_staging_file_swapped_for_a_symlink_is_refused_and_the_target_never_served(daemon, secret):
    stub = _stub(daemon)
    begun = stub.BeginSave(pb.BeginSaveRequest(job="j", step=1, rank=0, world_size=1,
                                               shards=[pb.ShardSpec(name="x", size=len(SECRET))]))
    staged = Path(begun.shards[0].path)
    staged.unlink()
    staged.symlink_to(secret)
    with pytest.raises(grpc.RpcError) as e:
        stub.CommitSave(pb.CommitSaveRequest(save_id=begun.save_id,
                                             digests=[pb.ShardDigest(name="x", checksum=_checksum.digest(SECRET))]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "x" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ReadShard(pb.ReadShardRequest(job="j", step=1, rank=0, shard="x")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert not list(daemon.local_dir.glob("jobs/*/*/*/*"))
    assert secret.read_bytes() == SECRET and not secret.is_symlink()


def test_staging_file_of_another_size_is_refused(daemon):
    stub = _stub(daemon)
    begun = stub.BeginSave(pb.BeginSaveRequest(job="j", step=1, rank=0, world_size=1,
                                               shards=[pb.ShardSpec(name="x", size=4)]))
    Path(begun.shards[0].path).write_bytes(b"longer than declared")
    with pytest.raises(grpc.RpcError) as e:
        stub.CommitSave(pb.CommitSaveRequest(save_id=begun.save_id,
                                             digests=[pb.ShardDigest(name="x", checksum="0" * 16)]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not list(daemon.local_dir.glob("jobs/*/*/*/*"))


def test_streamed_chunk_is_never_written_through_a_symlink(daemon, scratch):
    victim = scratch / "outside-victim"
    victim.write_bytes(b"precious")
    stub = _stub(daemon)
    begun = stub.BeginSave(pb.BeginSaveRequest(job="j", step=1, rank=0, world_size=1, transfer=pb.TRANSFER_STREAM,
                                               shards=[pb.ShardSpec(name="x", size=8)]))
    staged = daemon.local_dir / "staging" / begun.save_id / "x"
    staged.unlink()
    staged.symlink_to(victim)
    with pytest.raises(grpc.RpcError) as e:
        stub.WriteShard(iter([pb.WriteShardRequest(save_id=begun.save_id, shard="x", offset=0, data=b"EVILDATA")]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert victim.read_bytes() == b"precious"


def test_recycled_file_swapped_for_a_symlink_is_never_handed_out(daemon_factory, scratch):
    victim = scratch / "outside-victim"
    victim.write_bytes(b"v" * 8192)
    d = daemon_factory(args=("--keep-local", "1"))
    with d.client() as c:
        c.save("j", 1, 0, 1, {"x": np.full(8192, 1, np.uint8)}).result(30)
        c.save("j", 2, 0, 1, {"x": np.full(8192, 2, np.uint8)}).result(30)  # step 1's file goes to recycle/
        pooled = list((d.local_dir / "recycle").iterdir())
        assert len(pooled) == 1
        pooled[0].unlink()
        pooled[0].symlink_to(victim)
        c.save("j", 3, 0, 1, {"x": np.full(8192, 3, np.uint8)}).result(30)
        assert int(c.restore("j", 0).shards["x"].min()) == 3
    assert victim.read_bytes() == b"v" * 8192
    assert not any(p.is_symlink() for p in d.local_dir.rglob("*"))


def test_symlinked_directories_planted_in_local_dir_are_not_followed_at_start_up(daemon, scratch):
    outside = scratch / "outside-dir"
    (outside / "00000000000000000001" / "rank-0000000").mkdir(parents=True)
    (outside / "00000000000000000001" / "rank-0000000" / "x.data").write_bytes(b"keep me")
    (outside / "loose").write_bytes(b"keep me too")
    before = _tree(outside)
    with daemon.client() as c:
        c.save("j", 1, 0, 1, {"x": b"committed"}).result(30)
    daemon.kill()
    ld = daemon.local_dir
    (ld / "jobs" / "evil").symlink_to(outside)                        # a job dir
    (ld / "jobs" / "j" / "00000000000000000007").symlink_to(outside)  # a step dir
    (ld / "staging" / "leftover").symlink_to(outside)                 # a staging leftover
    (ld / "recycle" / "8.abc").symlink_to(outside / "loose")          # a pooled file
    daemon.start()
    assert _tree(outside) == before
    assert not any(p.is_symlink() for p in ld.rglob("*"))
    with daemon.client() as c:
        assert bytes(c.restore("j", 0).shards["x"]) == b"committed"


def test_symlinked_lock_file_refuses_start_and_leaves_the_target_alone(daemon, scratch):
    victim = scratch / "outside-victim"
    victim.write_bytes(b"do not truncate")
    daemon.kill()
    lock = daemon.local_dir / ".lock"
    lock.unlink()
    lock.symlink_to(victim)
    with pytest.raises(RuntimeError, match="did not start"):
        daemon.start(timeout=20)
    assert ".lock" in daemon.log_tail() or ".lock" in (daemon.log_path.read_text())
    assert victim.read_bytes() == b"do not truncate"


def test_a_committed_rank_failing_a_rule_at_start_up_is_quarantined_not_deleted(daemon):
    with daemon.client() as c:
        c.save("j", 1, 0, 1, {"x": b"precious bytes"}).result(30)
    data = next(daemon.local_dir.glob("jobs/j/*/*/x.*"))
    daemon.kill()
    os.truncate(data, 3)  # the manifest's size rule fails
    daemon.start()
    kept = list((daemon.local_dir / "quarantine").rglob("x.*"))
    assert len(kept) == 1 and kept[0].read_bytes() == b"pre"
    assert "quarantined" in daemon.log_path.read_text()
    with daemon.client() as c:
        assert c.latest("j") is None


def test_bad_dtype_shape_and_unstorable_names_are_refused_at_begin(daemon):
    stub = _stub(daemon)
    cases = [
        (pb.ShardSpec(name="x", size=8, dtype="<f4", shape=[3]), "shards.shape"),
        (pb.ShardSpec(name="x", size=8, dtype="float32", shape=[2]), "shards.dtype"),
        (pb.ShardSpec(name="x", size=8, dtype="torch:nonsense", shape=[8]), "shards.dtype"),
        (pb.ShardSpec(name="x", size=8, dtype="", shape=[8]), "shards.shape"),
        (pb.ShardSpec(name="n" * 255, size=1), "shards.name"),
    ]
    for spec, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.BeginSave(pb.BeginSaveRequest(job="j", step=1, rank=0, world_size=1, shards=[spec]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()
    assert not any((daemon.local_dir / "staging").iterdir())


def test_committed_file_swapped_for_a_symlink_is_not_served_by_read_shard(daemon, secret):
    with daemon.client() as c:
        c.save("j", 1, 0, 1, {"x": b"y" * len(SECRET)}).result(30)
    data = next(daemon.local_dir.glob("jobs/j/*/*/x.*"))
    data.unlink()
    data.symlink_to(secret)
    with pytest.raises(grpc.RpcError) as e:
        list(_stub(daemon).ReadShard(pb.ReadShardRequest(job="j", step=1, rank=0, shard="x")))
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
