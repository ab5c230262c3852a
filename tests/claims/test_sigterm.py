"""README, "Deploying the daemon" (operations): SIGTERM stops accepting saves, finishes in-flight
commits and replication within ``--shutdown-timeout``, keeps the drain queue on disk and exits 0;
nothing uncommitted is visible after a restart (staging leftovers are reclaimed). One daemon is
stopped with a commit, a replica push and a drain upload all in flight, and a save staged but
not committed; its peer and its S3 (moto) persistent tier are real servers."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc
from tierckptd.backends import open_backend
from tierckptd.persistent import manifest_key

from ..harness import free_port, wait_until
from ..servers import make_backend_target
from ._util import noise, rank_dir

GRACE = 8.0
SIZES = {"model": 400_000, "optim": 20_000}


def _shards(step: int) -> dict[str, bytes]:
    return {name: noise(size, step, i) for i, (name, size) in enumerate(SIZES.items())}


def _got(ck) -> dict[str, bytes]:
    return {name: bytes(a) for name, a in ck.shards.items()}


def test_sigterm_finishes_commits_and_replicas_keeps_the_drain_queue_and_exits_0(
        daemon_factory, request, tmp_path, monkeypatch) -> None:
    s3 = make_backend_target("s3", request, tmp_path, monkeypatch)
    ports = {n: free_port() for n in ("n0", "n1")}
    peers = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", "1",
             "--keep-local", "5")  # every step stays local
    n1 = daemon_factory("n1", port=ports["n1"], args=peers)
    # n0's commits wait 1.5 s before their manifest, and its drains wait before theirs: both
    # are in flight when the signal comes (a long rpc_timeout: the frozen peer is not given up on)
    stopping = (*peers, "--persistent", s3.url, "--shutdown-timeout", str(GRACE),
                "--knobs", "debug_commit_delay=1.5,debug_manifest_delay=600,rpc_timeout=30")
    n0 = daemon_factory("n0", port=ports["n0"], env=s3.env, args=stopping)
    queued = n0.local_dir / "drain-queue" / f"job.{2:020d}.{0:07d}.json"
    c = n0.client()
    try:
        wait_until(lambda: [p.up for p in c.status().peers] == [True], 30, "n0 to see n1")
        c.save("job", 1, 0, 1, _shards(1)).wait("peer", timeout=60)
        os.kill(n1.proc.pid, signal.SIGSTOP)  # n1 frozen: n0's next replica push cannot finish yet
        try:
            c.save("job", 2, 0, 1, _shards(2), persist=True).result(60)  # committed; replica and drain start
            wait_until(queued.exists, 20, "step 2 in the durable drain queue")
            # a save staged and never committed
            with grpc.insecure_channel(n0.address) as ch:
                st = pb_grpc.TierckptStub(ch).BeginSave(pb.BeginSaveRequest(
                    job="job", step=4, rank=0, world_size=1, shards=[pb.ShardSpec(name="model", size=1000)]),
                    timeout=10)
            Path(st.shards[0].path).write_bytes(b"half")
            # a commit in flight: its data files are in place, its manifest not yet
            fut3 = c.save("job", 3, 0, 1, _shards(3))
            rd = rank_dir(n0.local_dir, "job", 3, 0)
            wait_until(lambda: rd.is_dir() and len(list(rd.iterdir())) >= len(SIZES), 20, "step 3's commit to start")
            assert not (rd / "manifest.json").exists()
            n0.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "shutdown: stop accepting saves" in n0.log_text(), 20, "the shutdown to start")
            with pytest.raises(tierckpt.TierckptError):  # no new save while shutting down
                c.save("job", 5, 0, 1, _shards(5)).result(30)
        finally:
            os.kill(n1.proc.pid, signal.SIGCONT)
        try:
            rc = n0.proc.wait(GRACE + 60)  # generous: the grace, the gRPC server's stop, a busy machine
        except subprocess.TimeoutExpired:
            pytest.fail(f"tierckptd did not exit after SIGTERM:\n{n0.log_tail()}")
        assert rc == 0
        assert fut3.result(30).step == 3  # the in-flight commit was finished, not dropped
    finally:
        c.close()
    log = n0.log_text()
    assert "peer tier: waiting up to" in log and "shutdown complete" in log
    assert queued.exists()  # the drain that was uploading stays queued on disk
    with open_backend(s3.url) as be:
        assert not be.exists(manifest_key("job", 2, 0, 1))  # cut before its manifest: not visible
    with n1.client() as c1:  # the replica pushes finished within the grace
        for step in (2, 3):
            assert _got(c1.restore("job", 0, step=step)) == _shards(step)

    n0.args = (*peers, "--persistent", s3.url)  # restarted without the test hooks
    n0.start()
    with n0.client() as c:
        assert sorted(i.step for i in c.list("job")) == [1, 2, 3]
        with pytest.raises(tierckpt.NotFoundError):
            c.restore("job", 0, step=4)
        for step in (1, 2, 3):
            ck = c.restore("job", 0, step=step)
            assert ck.tier == "local" and _got(ck) == _shards(step)
            del ck
        with open_backend(s3.url) as be:  # the queued drain resumed
            wait_until(lambda: be.exists(manifest_key("job", 2, 0, 1)), 60, "step 2's drain to finish")
        wait_until(lambda: c.status().drain_backlog_steps == 0 and not queued.exists(), 30, "an empty drain queue")
    assert not [p for p in (n0.local_dir / "staging").rglob("*") if p.is_file()]  # step 4's leftovers reclaimed
