"""Every outcome typed (issue 25): a save that loses a race, an aborted or expired save, a full
local dir on restore and on an inbound replica each get their own exception class, in every
transfer mode; never the bare TierckptError (the class of UNKNOWN) and never DataLossError for
bytes that were not corrupt. Real daemons; the full local dirs are real small tmpfs mounts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import tierckpt
from tierckpt.common import status
from tierckpt.v1 import tierckpt_pb2 as pb

from ..harness import wait_until
from ._util import stubs

ROUNDS = int(os.environ.get("TIERCKPT_RACE_ROUNDS", "10"))


def _payload(who: int, size: int = 1 << 20) -> dict[str, np.ndarray]:
    return {"a": np.full(size, who, np.uint8), "b": np.full(size // 3, 100 + who, np.uint8)}


def _race(daemon, transfer: str, rounds: int, matrix) -> None:
    clients = [daemon.client(transfer=transfer) for _ in range(2)]
    outcomes: list[object] = []
    try:
        for step in range(1, rounds + 1):
            gate = threading.Barrier(2)
            got: list[object] = [None, None]

            def one(i: int, step: int = step, gate: threading.Barrier = gate, got: list = got) -> None:
                gate.wait(10)
                try:
                    got[i] = clients[i].save("race", step, 0, 1, _payload(i)).result(60)
                except BaseException as e:  # reported back below: nothing is lost in the thread
                    got[i] = e

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads), "a saver hung"
            assert all(g is not None for g in got), got  # each thread reported an outcome
            for g in got:
                if isinstance(g, BaseException):
                    assert type(g) is tierckpt.AbortedError, repr(g)  # the loser's own class
            assert any(isinstance(g, tierckpt.SaveResult) for g in got), got  # a winner, always
            ck = clients[0].restore("race", 0, step=step)
            got_t = ck.tensors()
            who = int(got_t["a"][0])
            assert who in (0, 1)
            for name, want in _payload(who).items():  # whole: both shards from the same writer
                assert np.array_equal(got_t[name].numpy(), want), (step, name)
            ck.close()
            outcomes.append(tuple(type(g).__name__ for g in got))
    finally:
        for c in clients:
            c.close()
    matrix.record(typed=sum(n == "AbortedError" for o in outcomes for n in o), committed=len(outcomes))


@pytest.mark.parametrize("transfer", ["shared", "stream"])
def test_concurrent_savers_of_one_rank_get_a_whole_winner_and_aborted_losers(daemon, transfer, matrix) -> None:
    _race(daemon, transfer, ROUNDS, matrix)
    # the winner survives kill -9 and a restart
    with daemon.client() as c:
        before = {n: v.numpy().copy() for n, v in c.restore("race", 0, step=ROUNDS).tensors().items()}
    daemon.kill()
    daemon.restart()
    with daemon.client() as c:
        after = c.restore("race", 0, step=ROUNDS).tensors()
        assert all(np.array_equal(after[n].numpy(), v) for n, v in before.items())


@pytest.mark.long
@pytest.mark.parametrize("transfer", ["shared", "stream"])
def test_concurrent_savers_many_rounds(daemon, transfer, matrix) -> None:
    _race(daemon, transfer, 150, matrix)


def test_aborted_and_expired_saves_are_aborted_error(daemon_factory, matrix) -> None:
    d = daemon_factory(args=("--staging-timeout", "0.5"))
    ch, stub, _ = stubs(d.tcp_address)
    with ch:
        def begin(step: int) -> str:
            req = pb.BeginSaveRequest(job="ab", step=step, rank=0, world_size=1,
                                      shards=[pb.ShardSpec(name="w", size=16)], transfer=pb.TRANSFER_STREAM)
            return stub.BeginSave(req, timeout=10).save_id

        def commit(save_id: str) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as ei:
                stub.CommitSave(pb.CommitSaveRequest(save_id=save_id), timeout=10)
            return ei.value

        sid = begin(1)
        stub.AbortSave(pb.AbortSaveRequest(save_id=sid), timeout=10)
        err = commit(sid)
        assert err.code() == grpc.StatusCode.ABORTED
        assert type(status.error_from_rpc(err)) is tierckpt.AbortedError  # named in the trailing metadata
        sid = begin(2)
        wait_until(lambda: "reclaiming staging of save" in d.log_text(), what="the save expired")
        err = commit(sid)
        assert err.code() == grpc.StatusCode.ABORTED and type(status.error_from_rpc(err)) is tierckpt.AbortedError
        matrix.code("ABORTED", 2)
    with d.client() as c:  # the same through the client: a save whose staging expired under it
        c.save("ab", 3, 0, 1, {"w": b"x" * 16}).result(30)


@contextlib.contextmanager
def _small_tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full local dir needs a small tmpfs mount, which this machine refuses: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(mount: Path, leave: int) -> None:
    """Leave about ``leave`` bytes free on the mount (something else on the node filled it after
    the daemon sized its local_capacity): the next large write fails with ENOSPC."""
    st = os.statvfs(mount)
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def _pair(daemon_factory, replicas: int):
    from tierckptd.testing import free_port

    ports = {n: free_port() for n in ("n0", "n1")}
    args = ("--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "--replicas", str(replicas),
            "--knobs=warm_ahead=0")
    return (daemon_factory("n0", port=ports["n0"], args=args, start=False),
            daemon_factory("n1", port=ports["n1"], args=args, start=False))


def test_restore_into_a_full_local_dir_is_capacity_not_data_loss(daemon_factory, matrix) -> None:
    n0, n1 = _pair(daemon_factory, replicas=0)
    with _small_tmpfs(n1.local_dir, "48m"):
        n0.start()
        n1.start()
        _fill(n1.local_dir, 4 << 20)
        with n0.client() as c0:
            c0.save("full", 1, 0, 1, {"w": np.ones(16 << 20, np.uint8)}).result(60)
        with n1.client() as c1:
            wait_until(lambda: c1.latest("full") == 1, what="n1 sees the step on n0")
            with pytest.raises(tierckpt.CapacityError) as ei:
                c1.restore("full", 0, step=1)
            assert type(ei.value) is tierckpt.CapacityError, repr(ei.value)
            (n1.local_dir / "filler").unlink()  # room again: the same restore succeeds
            ck = c1.restore("full", 0, step=1)
            assert ck.source_node == "n0" and int(ck.tensors()["w"].sum()) == 16 << 20
            ck.close()
        n1.kill()
    matrix.code("RESOURCE_EXHAUSTED")


def test_a_replica_for_a_full_receiver_names_the_full_peer(daemon_factory, matrix) -> None:
    n0, n1 = _pair(daemon_factory, replicas=1)
    with _small_tmpfs(n1.local_dir, "48m"):
        n1.start()
        n0.start()
        _fill(n1.local_dir, 4 << 20)
        with n0.client() as c0:
            wait_until(lambda: {p.node_id for p in c0.status().peers if p.up} == {"n1"}, what="n0 sees n1")
            fut = c0.save("rep", 1, 0, 1, {"w": np.ones(16 << 20, np.uint8)})
            fut.result(60)
            with pytest.raises(tierckpt.TierError) as ei:
                fut.wait("peer", timeout=60)
            assert "local_dir is full on node n1" in str(ei.value), ei.value  # not "connection reset"
        n1.kill()
    matrix.code("RESOURCE_EXHAUSTED")
