"""The fault matrix: one scenario per row. Each asserts that every step committed before the
fault restores byte for byte, that no step is ever visible as complete with missing or partial
data, and that no corrupt byte is returned; the counts go to the ``matrix`` recorder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import tierckpt
from tierckpt.errors import CapacityError, DeadlineExceededError, NotFoundError, TierckptError
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckptd.testing import free_port

from ..harness import Cluster, wait_until
from ..metrics_scrape import value
from ..threads import Checked, join_all
from ._util import (
    Checker,
    Proxy,
    data_files,
    flip_bit,
    rank_dir,
    save,
    shards_for,
    stored_files,
    stored_objects,
    stubs,
)

SIZES = {"model": 300_000, "optim": 40_000, "tiny": 3}
BIG = {"model": 48 << 20}
FAST = "refresh_interval=0.2,down_retry_max=0.5,rpc_timeout=2,fanout_deadline=1.5,inbound_idle_timeout=2"
JOB = "mx"


def knobs(*extra: str) -> str:
    return "--knobs=" + ",".join((FAST, *extra))


REDUNDANCY = {"replicas": (1, ()), "parity": (0, ("--redundancy", "parity:2+1"))}
"""The peer redundancies the node-loss rows run under: ``replicas = 1``, and ``parity:2+1`` (three
nodes form one group: a lost node's ranks are reconstructed from the other two)."""


def cluster(factory, n: int, redundancy: str, *extra: str) -> Cluster:
    replicas, args = REDUNDANCY[redundancy]
    return Cluster(factory, n, replicas=replicas, extra=(*args, *extra))


def staged_files(d) -> list[Path]:
    return [p for p in (d.local_dir / "staging").rglob("*") if p.is_file()]


def never_partial(c: tierckpt.Client, job: str, step: int) -> None:
    """A step is either absent or complete with every rank holding data."""
    for info in c.list(job):
        if info.step == step and info.complete:
            # (the persistent catalog does not read manifests for sizes; its ranks show 0 bytes)
            assert all(r.tiers and (r.nbytes > 0 or r.tiers == ("persistent",)) for r in info.ranks), info


def checksum_failures(port: int, tier: str) -> float:
    return value(port, f'tierckpt_checksum_failures_total{{tier="{tier}"}}')


# ----------------------------------------------------------------------------- kill -9 of the daemon

def test_kill9_during_staging(daemon, matrix) -> None:
    chk = Checker(matrix)
    with daemon.client() as c:
        for step in (1, 2):
            save(c, JOB, step, 0, SIZES)
    ch, stub, _ = stubs(daemon.tcp_address)
    with ch:
        st = stub.BeginSave(pb.BeginSaveRequest(job=JOB, step=3, rank=0, world_size=1,
                                                shards=[pb.ShardSpec(name="model", size=1000)]), timeout=10)
        Path(st.shards[0].path).write_bytes(b"half")
    daemon.kill()
    daemon.start()
    with daemon.client() as c:
        assert c.latest(JOB) == 2
        chk.expect_error(lambda: c.restore(JOB, rank=0, step=3), NotFoundError)
        for step in (1, 2):
            assert chk.restore_ok(c, JOB, step, 0, SIZES)
    assert not staged_files(daemon)  # reclaimed at start-up


def test_kill9_between_the_last_shard_and_the_manifest(daemon_factory, matrix) -> None:
    chk = Checker(matrix)
    d = daemon_factory(args=(knobs(),))
    with d.client() as c:
        save(c, JOB, 1, 0, SIZES)
    d.terminate()
    d.args = (knobs("debug_commit_delay=60"),)  # step 2's commit is held until the kill below
    d.start()
    with d.client() as c:
        fut = c.save(JOB, 2, 0, 1, shards_for(JOB, 2, 0, SIZES))
        rd = rank_dir(d.local_dir, JOB, 2, 0)
        wait_until(lambda: rd.exists() and len(list(rd.iterdir())) >= len(SIZES), 50, "data files in place")
        assert not (rd / "manifest.json").exists()
        d.kill()
        chk.expect_error(lambda: fut.result(30))  # the trainer learns the save did not commit
    d.args = (knobs(),)
    d.start()
    with d.client() as c:
        assert c.latest(JOB) == 1
        chk.expect_error(lambda: c.restore(JOB, rank=0, step=2), NotFoundError)
        assert chk.restore_ok(c, JOB, 1, 0, SIZES)
    assert not rd.exists()  # a rank directory without a manifest is reclaimed


@pytest.mark.parametrize("victim", ["sender", "receiver"])
def test_kill9_while_a_replica_is_in_flight(daemon_factory, matrix, victim: str) -> None:
    chk = Checker(matrix)
    cl = Cluster(daemon_factory, 2, replicas=1, extra=(knobs(),))
    n0, n1 = cl.d["n0"], cl.d["n1"]
    with n0.client() as c:
        save(c, JOB, 1, 0, SIZES).wait("peer", timeout=30)
        save(c, JOB, 2, 0, BIG)
        (n0 if victim == "sender" else n1).kill()  # the replica of step 2 is on its way
    with n1.client() if victim == "sender" else n0.client() as c:
        never_partial(c, JOB, 2)
    if victim == "sender":
        wait_until(lambda: not staged_files(n1), 60, "the receiver to drop the dead sender's partial replica")
        with n1.client() as c:
            held = {i.step for i in c.list(JOB)}
            assert 1 in held
            if 2 in held:  # it arrived whole before the kill
                assert chk.restore_ok(c, JOB, 2, 0, BIG)
        n0.start()
    else:
        n1.start()
        with n0.client() as c:  # the sender re-replicates to the restarted receiver
            wait_until(lambda: any(i.step == 2 and "n1" in i.ranks[0].nodes for i in c.list(JOB)), 30,
                       "the replica of step 2 on n1")
    with n0.client() as c:
        for step, sizes in ((1, SIZES), (2, BIG)):
            assert chk.restore_ok(c, JOB, step, 0, sizes)


@pytest.mark.parametrize("layout", ["content", "per-shard"])
def test_kill9_during_a_drain_upload_and_a_download(daemon_factory, tmp_path: Path, matrix, layout: str) -> None:
    chk = Checker(matrix)
    store = tmp_path / "store"
    args = ("--persistent", f"file://{store}", "--persist-every", "1", "--persistent-layout", layout)
    objects = "/content/" if layout == "content" else "/data/"  # one chunk or object per shard here
    d = daemon_factory("n0", args=(*args, knobs("debug_manifest_delay=60")))  # held until the kill below
    with d.client() as c:
        save(c, JOB, 1, 0, SIZES)
        wait_until(lambda: len(stored_files(store, objects)) == len(SIZES), 50, "shards uploaded")
        d.kill()  # every shard is up, the manifest is not
    assert not [p for p in store.rglob("*") if "/manifests/" in str(p) and p.is_file()]
    d.args = (*args, knobs())
    d.start()  # the drain resumes from the durable queue
    with d.client() as c:
        c.save(JOB, 2, 0, 1, shards_for(JOB, 2, 0, BIG)).wait("persistent", timeout=60)
        wait_until(lambda: {i.step for i in c.list(JOB) if "persistent" in i.tiers} >= {1, 2}, 30,
                   "steps 1 and 2 in the persistent tier")
    d.kill()
    d.wipe()  # a fresh node: restores come from the object store
    d.args = (*args, knobs("debug_commit_delay=60"))  # held until the kill below
    d.start()
    rd = rank_dir(d.local_dir, JOB, 2, 0)
    with d.client() as c:
        t = Checked(_swallow, lambda: c.restore(JOB, rank=0, step=2))
        t.start()
        wait_until(lambda: rd.exists() and any(rd.iterdir()), 50, "the download's data in place")
        d.kill()  # downloaded, not committed
        t.join(60)  # the interrupted restore ended with a typed error (anything else is raised here)
    d.args = (*args, knobs())
    d.start()
    with d.client() as c:
        never_partial(c, JOB, 2)
        for step, sizes in ((1, SIZES), (2, BIG)):
            assert chk.restore_ok(c, JOB, step, 0, sizes)


def _swallow(fn) -> None:
    """Call ``fn``; a typed tierckpt error is an accepted end (anything else is raised)."""
    try:
        fn()
    except TierckptError:
        pass


# ----------------------------------------------------------------------------- the trainer and the node

_TRAINER = r"""
import os, signal, sys, tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb
with tierckpt.Client(sys.argv[1]) as c:
    c.save("mx", 1, 0, 1, {"model": b"m" * 100000}).result(30)
    st = c._stub.BeginSave(pb.BeginSaveRequest(job="mx", step=2, rank=0, world_size=1,
                                               shards=[pb.ShardSpec(name="model", size=100000)]))
    with open(st.shards[0].path, "r+b") as f:
        f.write(b"x" * 5000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_trainer_killed_mid_save(daemon_factory, matrix) -> None:
    d = daemon_factory(args=("--staging-timeout", "1"))
    r = subprocess.run([sys.executable, "-c", _TRAINER, d.address], env=dict(os.environ), timeout=60)
    assert r.returncode == -signal.SIGKILL
    with d.client() as c:
        assert c.latest(JOB) == 1
        Checker(matrix).expect_error(lambda: c.restore(JOB, rank=0, step=2), NotFoundError)
        ck = c.restore(JOB, rank=0, step=1)
        matrix.record(committed=1, corrupt_returned=int(bytes(ck.shards["model"]) != b"m" * 100000))
    wait_until(lambda: not staged_files(d), 60, "the abandoned staging area to be reclaimed")
    assert d.alive()


@pytest.mark.parametrize("redundancy", ["replicas", "parity"])
def test_node_wiped_and_replaced_while_others_keep_saving(daemon_factory, matrix, redundancy: str) -> None:
    chk = Checker(matrix)
    cl = cluster(daemon_factory, 3, redundancy, knobs())
    world, committed = 3, []
    replaced = threading.Event()  # set once the new n1 is up
    after: dict[int, list[int]] = {0: [], 2: []}  # steps a trainer saved (and replicated) after that
    stop = threading.Event()

    def trainer(rank: int) -> None:
        with cl.d[f"n{rank}"].client() as c:
            step = 0
            while not stop.is_set():
                step += 1
                started_after = replaced.is_set()
                fut = save(c, JOB, step, rank, SIZES, world=world)  # the local commit never fails: this node is up
                try:
                    fut.wait("peer", timeout=30)
                except TierckptError:  # the replica's holder may be the node being replaced: a typed error
                    chk.matrix.record(typed=1)
                    continue
                committed.append((step, rank))
                if started_after:
                    after[rank].append(step)

    with cl.d["n1"].client() as c:
        for step in (1, 2):
            save(c, JOB, step, 1, SIZES, world=world).wait("peer", timeout=30)
            committed.append((step, 1))
    threads = [Checked(trainer, r) for r in (0, 2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: {r for _, r in committed} >= {0, 2}, 60, "both trainers saving")
        cl.replace("n1")  # kill -9, the local dir lost, a new daemon with the same id
        replaced.set()
        wait_until(lambda: all(after.values()), 120, "a save of each rank, replicated, after the replacement")
    finally:
        stop.set()
        join_all(threads, 120)
    with cl.d["n1"].client() as c:
        for step in (1, 2):  # the new node restores its rank's steps from the peers
            assert chk.restore_ok(c, JOB, step, 1, SIZES)
    for node in ("n0", "n2"):
        with cl.d[node].client() as c:
            for step, rank in committed:
                if f"n{rank}" == node:
                    assert chk.restore_ok(c, JOB, step, rank, SIZES)


# ----------------------------------------------------------------------------- bit flips

def test_bit_flips_in_a_local_file_a_replica_and_an_object(daemon_factory, tmp_path: Path, matrix) -> None:
    chk = Checker(matrix)
    store = tmp_path / "store"
    ports = {n: free_port() for n in ("n0", "n1")}

    def factory(node, port, args):
        return daemon_factory(node, port=port, args=(*args, "--metrics-port", str(ports[node])))

    cl = Cluster(factory, 2, replicas=1,
                 extra=("--persistent", f"file://{store}", "--persist-every", "1", knobs()))
    n0, n1 = cl.d["n0"], cl.d["n1"]
    with n0.client() as c:
        for step in (1, 2, 3):
            fut = save(c, JOB, step, 0, SIZES)
            fut.wait("peer", timeout=30)
            fut.wait("persistent", timeout=30)
    # local copy flipped: detected, the peer copy is used, counted
    flip_bit(data_files(n0.local_dir, JOB, 3, 0)[0], 10)
    with n0.client() as c:
        assert chk.restore_ok(c, JOB, 3, 0, SIZES)
        assert c.restore(JOB, rank=0, step=3).tier == "local"  # the repaired copy
    assert checksum_failures(ports["n0"], "local") >= 1
    # replica flipped and the local copy gone: detected on receipt, the object store is used
    flip_bit(data_files(n1.local_dir, JOB, 2, 0)[0], 10)
    n0.kill()
    n0.wipe()
    cl.start("n0")
    n0 = cl.d["n0"]
    with n0.client() as c:
        assert chk.restore_ok(c, JOB, 2, 0, SIZES)
        assert c.restore(JOB, rank=0, step=2).tier in ("local", "persistent")
    assert checksum_failures(ports["n0"], "peer") >= 1
    # object flipped, no other copy: DataLoss, never a wrong byte
    for obj in stored_objects(store, JOB, 1, 0, "model"):  # its chunk (named by step 1 only)
        flip_bit(obj, 5)
    n1.kill()
    n0.kill()
    n0.wipe()
    cl.start("n0")
    with cl.d["n0"].client() as c:
        chk.expect_error(lambda: c.restore(JOB, rank=0, step=1), tierckpt.DataLossError)  # every copy damaged
    assert checksum_failures(ports["n0"], "persistent") >= 1


# ----------------------------------------------------------------------------- the object store down and hung

def test_object_store_down_and_hung(daemon_factory, moto_server, matrix) -> None:
    chk = Checker(matrix)
    bucket = moto_server.create_bucket()
    proxy = Proxy(("127.0.0.1", moto_server.port))
    env = {**moto_server.env, "AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1",
           "AWS_RETRY_MODE": "standard"}
    try:
        d = daemon_factory(env=env, args=("--persistent", f"s3://{bucket}/ck", "--persist-every", "1",
                                          knobs("catalog_wait=1,catalog_ttl=0.5")))
        with d.client() as c:
            save(c, JOB, 1, 0, SIZES).wait("persistent", timeout=60)
            for mode in ("cut", "hang"):
                getattr(proxy, mode)()
                step = 2 if mode == "cut" else 3
                fut = save(c, JOB, step, 0, SIZES)  # saving goes on locally
                chk.expect_error(lambda f=fut: f.wait("persistent", timeout=3), DeadlineExceededError)
                ch, stub, _ = stubs(d.tcp_address)
                with ch:
                    t0 = time.monotonic()
                    resp = stub.Latest(pb.LatestRequest(job=JOB), timeout=90)
                    # README: a source that does not answer is left out (catalog_wait=1 s here); 30 s
                    # is room for a loaded machine, far below a wait on the hung store (SDK: 60 s).
                    assert time.monotonic() - t0 < 30 and resp.step == step
                    assert any("persistent tier" in u for u in resp.unreachable), resp.unreachable
                assert chk.restore_ok(c, JOB, step, 0, SIZES)
                proxy.heal()
                fut.wait("persistent", timeout=60)  # the backlog drains once the store is back
            moto_server.pause()  # SIGSTOP of the store itself
            fut = save(c, JOB, 4, 0, SIZES)
            chk.expect_error(lambda: fut.wait("persistent", timeout=3), DeadlineExceededError)
            t0 = time.monotonic()
            assert c.latest(JOB) == 4 and time.monotonic() - t0 < 30  # as above: not waiting on the store
            moto_server.resume()
            fut.wait("persistent", timeout=90)
            for step in (1, 2, 3, 4):
                assert chk.restore_ok(c, JOB, step, 0, SIZES)
    finally:
        moto_server.resume()
        proxy.close()


# ----------------------------------------------------------------------------- peers

@pytest.mark.parametrize("how,redundancy", [("killed", "replicas"), ("hung", "replicas"), ("killed", "parity")])
def test_a_peer_killed_or_hung(daemon_factory, matrix, how: str, redundancy: str) -> None:
    chk = Checker(matrix)
    cl = cluster(daemon_factory, 3, redundancy, knobs())
    n0, n1 = cl.d["n0"], cl.d["n1"]
    with n0.client() as c:
        save(c, JOB, 1, 0, SIZES).wait("peer", timeout=30)
    if how == "killed":
        n1.kill()
    else:
        n1.proc.send_signal(signal.SIGSTOP)
    try:
        with n0.client() as c:
            fut = save(c, JOB, 2, 0, SIZES)  # the local commit does not wait for peers
            if redundancy == "replicas":
                fut.wait("peer", timeout=60)  # placement moves on to a live peer
            else:  # n1 protects a chunk of n0's ranks: no other node can (a typed error, the step is local)
                chk.expect_error(lambda: fut.wait("peer", timeout=60), TierckptError)
            ch, stub, _ = stubs(n0.tcp_address)
            with ch:
                t0 = time.monotonic()
                resp = stub.Latest(pb.LatestRequest(job=JOB), timeout=90)
            # README: nodes that do not answer within fanout_deadline (1.5 s here) are left out; 30 s
            # is room for a loaded machine, far below a wait on the hung peer (no answer ever).
            assert resp.step == 2 and time.monotonic() - t0 < 30
            for step in (1, 2):
                assert chk.restore_ok(c, JOB, step, 0, SIZES)
    finally:
        if how == "hung":
            n1.proc.send_signal(signal.SIGCONT)
    assert n0.alive()


def test_network_partition_between_two_daemons(daemon_factory, matrix) -> None:
    """Partitioned through TCP proxies on the peers' control channel (a network-namespace variant
    is under the ``long`` marker)."""
    chk = Checker(matrix)
    ports = {n: free_port() for n in ("n0", "n1")}
    proxies = {n: Proxy(("127.0.0.1", ports[n])) for n in ports}
    peers = ",".join(f"{n}=127.0.0.1:{proxies[n].port}" for n in ports)
    d = {n: daemon_factory(n, port=ports[n], args=("--peers", peers, "--replicas", "1", knobs()))
         for n in ports}
    try:
        with d["n0"].client() as c:
            save(c, JOB, 1, 0, SIZES).wait("peer", timeout=30)
            for p in proxies.values():
                p.cut()
            fut = save(c, JOB, 2, 0, SIZES)  # saving goes on in a partition
            chk.expect_error(lambda: fut.wait("peer", timeout=3), DeadlineExceededError, TierckptError)
            never_partial(c, JOB, 2)
            for p in proxies.values():
                p.heal()
            # Healed: the replica catches up (the round under way may still have failed on a
            # channel in reconnect backoff; the peer's return triggers another round either way).
            wait_until(lambda: any(i.step == 2 and "n1" in i.ranks[0].nodes for i in c.list(JOB)), 30,
                       "the replica of step 2 on n1 after the partition healed")
            assert fut.wait("peer", timeout=30) == ["n1"]
            for step in (1, 2):
                assert chk.restore_ok(c, JOB, step, 0, SIZES)
        d["n0"].kill()
        d["n0"].wipe()
        d["n0"].start()
        with d["n0"].client() as c:
            for step in (1, 2):
                assert chk.restore_ok(c, JOB, step, 0, SIZES)
    finally:
        for p in proxies.values():
            p.close()


# ----------------------------------------------------------------------------- capacity

def test_capacity_full(daemon_factory, matrix) -> None:
    chk = Checker(matrix)
    d = daemon_factory(args=("--local-capacity", str(1 << 20), "--keep-local", "2"))
    with d.client() as c:
        save(c, JOB, 1, 0, SIZES)
        chk.expect_error(lambda: save(c, JOB, 2, 0, {"huge": 2 << 20}), CapacityError)
        assert chk.restore_ok(c, JOB, 1, 0, SIZES)
        assert not staged_files(d)


def test_real_enospc_on_a_small_tmpfs(daemon_factory, tmp_path: Path, matrix) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    chk = Checker(matrix)
    try:
        d = daemon_factory(args=("--local-dir", str(mnt / "data"), "--local-capacity", str(64 << 20)))
        with d.client() as c:
            save(c, JOB, 1, 0, SIZES)
            chk.expect_error(lambda: save(c, JOB, 2, 0, {"huge": 3 << 20}), CapacityError)  # issue 25: one class
            assert chk.restore_ok(c, JOB, 1, 0, SIZES)
            save(c, JOB, 3, 0, SIZES)  # the daemon recovered: the next save that fits commits
            assert chk.restore_ok(c, JOB, 3, 0, SIZES)
        d.kill()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_grpc_status_of_a_save_on_a_full_disk_is_typed(matrix) -> None:
    """The client maps RESOURCE_EXHAUSTED to CapacityError (the type the rows above expect)."""
    from tierckpt.common.status import error_for_code

    assert isinstance(error_for_code(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), CapacityError)
