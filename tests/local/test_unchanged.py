"""Unchanged shards (issue 13 item 2): the daemon links the base step's committed file instead of
staging a copy, counts it once, never recycles it while linked, and falls back to a write
whenever it cannot link. Real daemons, real clients, files on tmpfs."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc
from tierckptd.local.rules import MIN_CHARGE

from ..harness import free_port
from ..metrics_scrape import scrape as metrics

MIB = 1 << 20

NO_WARM_POOL = ("--knobs", "warm_pool=0")
"""For the tests that check the bytes charged exactly: no warm pool files (see tierckptd.local.warm)."""


def _rand(seed: int, n: int = MIB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=n, dtype=np.uint8)


def _file(d, job: str, step: int, shard: str) -> Path:
    (p,) = d.local_dir.glob(f"jobs/{job}/{step:020d}/rank-0000000/{shard}.*")
    return p


def _check(c, job: str, step: int, expect: dict[str, np.ndarray]) -> None:
    ck = c.restore(job, 0, step)
    assert set(ck.shards) == set(expect)
    for name, arr in expect.items():
        assert np.array_equal(np.asarray(ck.shards[name]), arr), (step, name)
    ck.close()


@pytest.mark.parametrize("transfer", ["shared", "stream"])
def test_unchanged_shard_shares_the_base_file(daemon_factory, transfer):
    mport = free_port()
    d = daemon_factory(args=("--keep-local", "5", "--metrics-port", str(mport), *NO_WARM_POOL))
    frozen, w1, w2 = _rand(1), _rand(2, 300_000), _rand(3, 300_000)
    with tierckpt.Client(d.address if transfer == "shared" else d.tcp_address, transfer=transfer) as c:
        r1 = c.save("job", 1, 0, 1, {"frozen": frozen, "w": w1}, unchanged=["frozen"]).result(30)
        assert r1.shared_bytes == 0  # no step committed by this client yet: the hint is ignored
        used1 = c.status().used_bytes
        r2 = c.save("job", 2, 0, 1, {"frozen": frozen, "w": w2}, unchanged=["frozen"]).result(30)
        assert r2.shared_bytes == frozen.nbytes and r2.nbytes == frozen.nbytes + w2.nbytes
        # Charged once: step 2 added only w2 and its manifest (the linked file is not counted twice).
        assert c.status().used_bytes - used1 == w2.nbytes + MIN_CHARGE
        _check(c, "job", 1, {"frozen": frozen, "w": w1})
        _check(c, "job", 2, {"frozen": frozen, "w": w2})
    f1, f2 = os.stat(_file(d, "job", 1, "frozen")), os.stat(_file(d, "job", 2, "frozen"))
    assert (f1.st_ino, f1.st_nlink) == (f2.st_ino, 2)
    assert os.stat(_file(d, "job", 1, "w")).st_ino != os.stat(_file(d, "job", 2, "w")).st_ino
    assert metrics(mport)['tierckpt_shared_bytes_total{tier="local"}'] == frozen.nbytes


def test_unchanged_name_not_in_shards_is_refused_and_nothing_stored(daemon):
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"a": _rand(1, 5000)}).result(30)
        with pytest.raises(tierckpt.InvalidArgumentError, match="unchanged"):
            c.save("job", 2, 0, 1, {"a": _rand(1, 5000)}, unchanged=["b"])
        with pytest.raises(tierckpt.InvalidArgumentError, match="unchanged"):
            c.save("job", 2, 0, 1, {"a": _rand(1, 5000)}, unchanged="a")
        assert [i.step for i in c.list("job")] == [1]
    with grpc.insecure_channel(daemon.address) as ch:  # a client that skips the check
        stub = pb_grpc.TierckptStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.BeginSave(pb.BeginSaveRequest(job="job", step=2, rank=0, world_size=1, base_step=1,
                                               shards=[pb.ShardSpec(name="a", size=5000)], unchanged=["b"]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unchanged" in e.value.details()
    with daemon.client() as c:
        assert c.status().staging_bytes == 0
        _check(c, "job", 1, {"a": _rand(1, 5000)})


def test_base_gone_or_different_falls_back_to_a_write(daemon_factory):
    d = daemon_factory(args=("--keep-local", "1"))
    a, b = _rand(1, 200_000), _rand(2, 200_000)
    with d.client() as c1, d.client() as c2:
        c1.save("job", 1, 0, 1, {"a": a}).result(30)
        c2.save("job", 2, 0, 1, {"a": b}).result(30)  # retention evicts step 1, c1's base
        r = c1.save("job", 3, 0, 1, {"a": a}, unchanged=["a"]).result(30)
        assert r.shared_bytes == 0
        _check(c1, "job", 3, {"a": a})
        # A different dtype/shape than the base's shard is not shared either.
        r = c1.save("job", 4, 0, 1, {"a": a.view(np.int16)}, unchanged=["a"]).result(30)
        assert r.shared_bytes == 0
        _check(c1, "job", 4, {"a": a.view(np.int16)})
    assert os.stat(_file(d, "job", 4, "a")).st_nlink == 1


def test_a_linked_file_is_never_recycled(daemon_factory):
    """Evicting the base step unlinks its name only: if the name went to the recycle pool, the
    next save of a shard of the same size would overwrite the inode that later steps share."""
    d = daemon_factory(args=("--keep-local", "2"))
    frozen = _rand(1)
    with d.client() as c:
        for step in (1, 2, 3):  # step 3 commits: retention evicts step 1
            c.save("job", step, 0, 1, {"frozen": frozen, "w": _rand(10 + step, 4096)}, unchanged=["frozen"]).result(30)
        assert [i.step for i in c.list("job")] == [2, 3]
        assert os.stat(_file(d, "job", 3, "frozen")).st_nlink == 2
        for step in (4, 5):  # same-size shards: each takes a pooled file if one of that size exists
            c.save("other", step, 0, 1, {"g": _rand(100 + step)}).result(30)
            c.save("other", step + 10, 0, 1, {"g": _rand(200 + step)}).result(30)
        _check(c, "job", 2, {"frozen": frozen, "w": _rand(12, 4096)})
        _check(c, "job", 3, {"frozen": frozen, "w": _rand(13, 4096)})
        # Evict step 2 as well (a step 4 sharing nothing): step 3 keeps the file alone, intact.
        c.save("job", 4, 0, 1, {"frozen": _rand(7), "w": _rand(14, 4096)}).result(30)
        assert os.stat(_file(d, "job", 3, "frozen")).st_nlink == 1
        c.save("other", 30, 0, 1, {"g": _rand(300)}).result(30)
        _check(c, "job", 3, {"frozen": frozen, "w": _rand(13, 4096)})


def test_capacity_counts_a_shared_file_once_and_credits_it_with_its_last_name(daemon_factory):
    # 3 MiB + a little: three 1 MiB files and the manifests' minimum charges fit, four do not.
    d = daemon_factory(args=("--local-capacity", str(3 * MIB + 64 * 1024), "--keep-local", "3", *NO_WARM_POOL))
    frozen = _rand(1)
    with d.client() as c:
        for step in (1, 2, 3):  # one inode for the three steps
            c.save("job", step, 0, 1, {"frozen": frozen}, unchanged=["frozen"]).result(30)
        assert c.status().used_bytes == MIB + 3 * MIN_CHARGE  # one file, three manifests
        c.save("other", 1, 0, 1, {"x": _rand(2), "y": _rand(3)}).result(30)  # fits only if counted once
        assert c.status().used_bytes == 3 * MIB + 4 * MIN_CHARGE
        with pytest.raises(tierckpt.CapacityError):  # evicting steps 1 and 2 of "job" frees nothing
            c.save("other", 2, 0, 1, {"x": _rand(4)})
        assert [i.step for i in c.list("job")] == [1, 2, 3]
        _check(c, "job", 3, {"frozen": frozen})


def test_restart_recovers_linked_steps(daemon_factory):
    d = daemon_factory(args=("--keep-local", "3", *NO_WARM_POOL))
    frozen, w = _rand(1), _rand(2, 8192)
    with d.client() as c:
        c.save("job", 1, 0, 1, {"frozen": frozen, "w": w}).result(30)
        c.save("job", 2, 0, 1, {"frozen": frozen, "w": w}, unchanged=["frozen", "w"]).result(30)
        used = c.status().used_bytes
    d.restart()
    with d.client() as c:
        assert [i.step for i in c.list("job")] == [1, 2]
        assert c.status().used_bytes == used == frozen.nbytes + w.nbytes + 2 * MIN_CHARGE  # and two manifests
        _check(c, "job", 1, {"frozen": frozen, "w": w})
        _check(c, "job", 2, {"frozen": frozen, "w": w})
    assert not list(d.local_dir.glob("quarantine/**/manifest.json"))
    assert os.stat(_file(d, "job", 2, "frozen")).st_nlink == 2


def test_a_flipped_byte_in_a_shared_file_fails_both_steps(daemon):
    frozen = _rand(1, 100_000)
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"frozen": frozen}).result(30)
        c.save("job", 2, 0, 1, {"frozen": frozen}, unchanged=["frozen"]).result(30)
    with open(_file(daemon, "job", 2, "frozen"), "r+b") as fh:
        fh.seek(4321)
        fh.write(bytes([frozen[4321] ^ 0xFF]))
    with daemon.client() as c:
        v = c.verify_job("job")  # `tierckpt verify`: both steps read the one inode
        assert v.mismatches == 2 and sorted((x.step, x.state) for x in v.copies) == [(1, "mismatch"), (2, "mismatch")]
        for step in (1, 2):
            with pytest.raises(tierckpt.DataLossError):
                c.restore("job", 0, step)


def test_a_base_step_resaved_by_another_writer_is_not_shared(daemon_factory):
    d = daemon_factory(args=("--keep-local", "5"))
    mine, theirs = _rand(1, 100_000), _rand(2, 100_000)
    with d.client() as c1, d.client() as c2:
        c1.save("job", 1, 0, 1, {"a": mine}).result(30)
        c2.save("job", 1, 0, 1, {"a": theirs}).result(30)  # the same step, other bytes, another save
        r = c1.save("job", 2, 0, 1, {"a": mine}, unchanged=["a"]).result(30)
        assert r.shared_bytes == 0  # c1's hint is about its own save of step 1, which is gone
        _check(c1, "job", 2, {"a": mine})
