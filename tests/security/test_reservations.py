"""A reservation evicts only its own job's steps, or steps already safe in another tier, against a
real daemon: a writer that never writes a byte cannot cost another job a step that exists only in
this node's local tier (a victim's steps [1, 2, 3] stay [1, 2, 3])."""

from __future__ import annotations

from pathlib import Path

import grpc
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

from ..harness import wait_until

MB = 1 << 20


def _reserve(daemon, job: str, step: int, size: int) -> grpc.StatusCode | None:
    """BeginSave of ``size`` bytes that never writes a byte (None: reserved; else the error code)."""
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.TierckptStub(ch)
        try:
            resp = stub.BeginSave(pb.BeginSaveRequest(job=job, step=step, rank=0, world_size=1,
                                                      shards=[pb.ShardSpec(name="w", size=size)],
                                                      transfer=pb.TRANSFER_STREAM), timeout=30)
        except grpc.RpcError as e:
            return e.code()
        stub.AbortSave(pb.AbortSaveRequest(save_id=resp.save_id), timeout=30)
        return None


def _steps(c: tierckpt.Client, job: str) -> list[int]:
    return [i.step for i in c.list(job)]


def test_a_reservation_never_evicts_another_jobs_only_copy(daemon_factory) -> None:
    d = daemon_factory("n0", args=("--local-capacity", str(5 * MB), "--keep-local", "3"))
    with d.client() as c:
        for step in (1, 2, 3):
            c.save("victim", step, 0, 1, {"w": bytes([step]) * 900_000}).result(30)
        assert _reserve(d, "writer", 1, 3 * MB) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _steps(c, "victim") == [1, 2, 3]
        # Its own job's older steps are the writer's to evict.
        c.save("writer", 1, 0, 1, {"w": b"a" * 900_000}).result(30)
        c.save("writer", 2, 0, 1, {"w": b"b" * 900_000}).result(30)
        assert _reserve(d, "writer", 3, 1_500_000) is None
        assert _steps(c, "writer") == [2] and _steps(c, "victim") == [1, 2, 3]


def test_steps_safe_in_the_persistent_tier_may_make_room(daemon_factory, tmp_path: Path) -> None:
    d = daemon_factory("n0", args=("--local-capacity", str(5 * MB), "--keep-local", "3",
                                   "--persistent", f"file://{tmp_path / 'store'}", "--persist-every", "1"))
    with d.client() as c:
        for step in (1, 2, 3):
            c.save("victim", step, 0, 1, {"w": bytes([step]) * 900_000}).wait("persistent", timeout=60)
        assert _reserve(d, "writer", 1, 3 * MB) is None  # victim's old steps are safe in the store
        assert _steps(c, "victim") == [1, 2, 3]  # listed still: in the persistent tier
        assert bytes(c.restore("victim", 0, step=1).shards["w"])[:1] == b"\x01"


def test_steps_replicated_to_a_live_peer_may_make_room(daemon_factory) -> None:
    from ..harness import Cluster

    cl = Cluster(daemon_factory, 2, extra=("--local-capacity", str(5 * MB), "--keep-local", "3",
                                          "--knobs", "refresh_interval=0.2"))
    n0 = cl.d["n0"]
    with n0.client() as c:
        for step in (1, 2, 3):
            c.save("victim", step, 0, 1, {"w": bytes([step]) * 900_000}).wait("peer", timeout=60)
        wait_until(lambda: _reserve(n0, "writer", 1, 3 * MB) is None, what="room from replicated steps")
        assert bytes(c.restore("victim", 0, step=1).shards["w"])[:1] == b"\x01"  # from n1
