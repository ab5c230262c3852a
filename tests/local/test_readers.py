"""Readers and savers: restored files return to the recycle pool once the client unmaps them."""

from __future__ import annotations

import gc

import numpy as np
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

from ..harness import wait_until


def _begin_recycled(daemon, step: int, size: int) -> bool:
    """Whether a new save of one ``size``-byte shard gets a recycled file (the save is aborted)."""
    import grpc

    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.TierckptStub(ch)
        begun = stub.BeginSave(pb.BeginSaveRequest(job="j", step=step, rank=0, world_size=1,
                                                   shards=[pb.ShardSpec(name="x", size=size)]), timeout=10)
        stub.AbortSave(pb.AbortSaveRequest(save_id=begun.save_id), timeout=10)
        return begun.shards[0].recycled


def test_closed_checkpoint_lets_its_files_be_recycled(daemon_factory):
    d = daemon_factory(args=("--keep-local", "1"))
    with tierckpt.Client(d.address) as c:
        c.save("j", 1, 0, 1, {"x": np.full(4096, 1, np.uint8)}).result()
        with c.restore("j", 0, step=1) as ck:
            assert int(ck.shards["x"][0]) == 1
        assert ck.shards == {}
        c.save("j", 2, 0, 1, {"x": np.full(4096, 2, np.uint8)}).result()  # evicts step 1 into the pool
        assert _begin_recycled(d, 3, 4096)


def test_a_live_array_keeps_the_file_out_of_the_pool_until_collected(daemon_factory):
    d = daemon_factory(args=("--keep-local", "1"))
    with tierckpt.Client(d.address) as c:
        c.save("j", 1, 0, 1, {"x": np.full(8192, 1, np.uint8)}).result()
        ck = c.restore("j", 0, step=1)
        arr = ck.shards["x"]
        ck.close()  # arr still maps the file: no release yet
        c.save("j", 2, 0, 1, {"x": np.full(8192, 2, np.uint8)}).result()  # evicts step 1: held
        assert not _begin_recycled(d, 3, 8192)
        assert int(arr[0]) == 1 and int(arr[-1]) == 1  # the reader's view never changes
        del arr, ck
        gc.collect()
        # released from the client's background thread
        wait_until(lambda: _begin_recycled(d, 4, 8192), 60, "the release to reach the daemon", 0.05)


def test_streamed_restore_holds_no_loan(daemon_factory):
    d = daemon_factory(args=("--keep-local", "1"))
    with tierckpt.Client(d.address, transfer="stream") as c:
        c.save("j", 1, 0, 1, {"x": np.full(4096, 1, np.uint8)}).result()
        ck = c.restore("j", 0, step=1)  # kept alive: a streamed copy maps nothing
        c.save("j", 2, 0, 1, {"x": np.full(4096, 2, np.uint8)}).result()
        assert _begin_recycled(d, 3, 4096)
        assert int(ck.shards["x"][0]) == 1


def test_release_of_an_unknown_copy_is_answered_not_released(daemon):
    import grpc

    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.TierckptStub(ch)
        assert not stub.Release(pb.ReleaseRequest(job="j", step=1, rank=0, generation="abc"), timeout=10).released
        try:
            stub.Release(pb.ReleaseRequest(job="j", step=1, rank=0, generation=""), timeout=10)
            raise AssertionError("an empty generation was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "generation" in e.details()


def test_many_small_shards_round_trip_through_batched_copies(daemon_factory):
    from tierckpt._transfer import batches

    assert batches([3, 3, 3, 3, 3], lambda x: x, limit=6) == [[3, 3], [3, 3], [3]]
    d = daemon_factory(args=("--keep-local", "1"))
    with tierckpt.Client(d.address) as c:
        for step in (1, 2, 3):  # the third save writes into recycled files
            shards = {f"s{i:03d}": np.full(1000 + i, (i + step) % 251, np.uint8) for i in range(300)}
            c.save("j", step, 0, 1, shards).result()
            with c.restore("j", 0, step=step) as ck:
                assert all(np.array_equal(ck.shards[n], a) for n, a in shards.items())
