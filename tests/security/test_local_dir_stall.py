"""A trainer who could write the local dir plants FIFOs, sockets and renamed directories where the
daemon keeps its files, to stall its start-up scan (an open of a FIFO without a writer waits
forever). Against real daemons: the start-up completes within seconds, the planted steps are set
aside (quarantined, logged, counted) and never served, every other step is."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from tierckpt.errors import NotFoundError
from tierckptd.testing import free_port

from ..metrics_scrape import scrape

STEP_W = 20


def _rank_dir(ld: Path, job: str, step: int) -> Path:
    return ld / "jobs" / job / f"{step:0{STEP_W}d}" / "rank-0000000"


def _fifo_for(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _socket_at(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    return s


def test_fifos_and_a_renamed_jobs_dir_do_not_stall_start_up(daemon_factory):
    port = free_port()
    d = daemon_factory(args=("--keep-local", "10", "--metrics-port", str(port)))
    with d.client() as c:
        for step in range(1, 6):
            c.save("j", step, 0, 1, {"x": np.full(4096, step, np.uint8)}).result(30)
    d.kill()
    ld = d.local_dir
    # The trainer renames jobs/ and rebuilds it as its own tree (the old 2770 root allowed it) ...
    (ld / "jobs").rename(ld / "jobs.renamed")
    (ld / "jobs").mkdir()
    (ld / "jobs.renamed" / "j").rename(ld / "jobs" / "j")
    # ... with a FIFO where step 2's shard file and step 3's manifest should be, a socket for step 4's
    # manifest, FIFOs in staging/, recycle/, policies/ and drain-queue/, and a FIFO for quarantine/.
    _fifo_for(next(_rank_dir(ld, "j", 2).glob("x.*")))
    _fifo_for(_rank_dir(ld, "j", 3) / "manifest.json")
    (_rank_dir(ld, "j", 4) / "manifest.json").unlink()
    sock = _socket_at(_rank_dir(ld, "j", 4) / "manifest.json")
    os.mkfifo(ld / "staging" / "leftover")
    os.mkfifo(ld / "recycle" / "4096.deadbeef")
    os.mkfifo(ld / "policies" / "j.json")
    os.mkfifo(ld / "drain-queue" / f"j.{9:020d}.{0:07d}.json")
    (ld / "quarantine").rmdir()
    os.mkfifo(ld / "quarantine")
    t0 = time.monotonic()
    try:
        d.start(timeout=20)
    finally:
        sock.close()
    started = time.monotonic() - t0
    assert started < 10, f"start-up took {started:.1f}s"
    with d.client() as c:
        assert [i.step for i in c.list("j")] == [1, 5]
        assert c.latest("j") == 5
        assert bytes(c.restore("j", 0, step=1).shards["x"]) == bytes([1]) * 4096
        for step in (2, 3, 4):
            with pytest.raises(NotFoundError):
                c.restore("j", 0, step=step)
        c.save("j", 6, 0, 1, {"x": np.full(4096, 6, np.uint8)}).result(30)  # still saves
    log = d.log_path.read_text()
    assert log.count("quarantined jobs/j/") == 3 and "moved aside" in log
    # the planted ranks are kept for the operator in quarantine/ (a fresh directory), not deleted
    kept = sorted(p.parent.parent.name for p in (ld / "quarantine" / "j").glob("*/*/manifest.json"))
    assert kept == [f"{s:0{STEP_W}d}" for s in (2, 3, 4)]
    assert stat.S_ISFIFO(next((ld / "quarantine" / "j" / f"{3:0{STEP_W}d}").glob("*/manifest.json")).lstat().st_mode)
    assert not (ld / "staging" / "leftover").exists() and not (ld / "recycle" / "4096.deadbeef").exists()
    assert [p.name for p in ld.glob(".quarantine.unsafe.*")] and (ld / "quarantine").is_dir()
    assert scrape(port)["tierckpt_local_quarantined_total"] == 4.0  # three ranks, one top-level entry


def test_a_fifo_planted_in_a_running_daemons_files_is_refused_at_once(daemon):
    """At run time too: a FIFO where a committed shard or a staging file should be is refused
    (DataLoss / FailedPrecondition), never waited on."""
    import grpc
    from tierckpt.v1 import tierckpt_pb2 as pb
    from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

    with daemon.client() as c:
        c.save("j", 1, 0, 1, {"x": b"committed bytes"}).result(30)
    _fifo_for(next(_rank_dir(daemon.local_dir, "j", 1).glob("x.*")))
    stub = pb_grpc.TierckptStub(grpc.insecure_channel(daemon.address))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ReadShard(pb.ReadShardRequest(job="j", step=1, rank=0, shard="x"), timeout=10))
    assert e.value.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND), e.value
    begun = stub.BeginSave(pb.BeginSaveRequest(job="j", step=2, rank=0, world_size=1, transfer=pb.TRANSFER_STREAM,
                                               shards=[pb.ShardSpec(name="y", size=8)]))
    _fifo_for(daemon.local_dir / "staging" / begun.save_id / "y")
    with pytest.raises(grpc.RpcError) as e:
        stub.WriteShard(iter([pb.WriteShardRequest(save_id=begun.save_id, shard="y", offset=0, data=b"12345678")]),
                        timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert time.monotonic() - t0 < 8
