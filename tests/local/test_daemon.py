"""Local tier end to end: a real tierckptd subprocess, a real client, files on tmpfs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tierckpt
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckpt.v1 import tierckpt_pb2_grpc as pb_grpc

from ..harness import wait_until


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "b": rng.integers(-5, 5, size=(7,), dtype=np.int64),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float16),
        "mask": rng.integers(0, 2, size=(3, 3)).astype(bool),
    }


def _committed_manifests(daemon) -> list[Path]:
    return sorted(daemon.local_dir.glob("jobs/*/*/*/manifest.json"))


@pytest.mark.parametrize("transfer", ["shared", "stream"])
def test_round_trip_all_buffer_kinds(daemon, transfer):
    import torch

    arrays = _arrays()
    t32 = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tbf = torch.linspace(-1, 1, 10).to(torch.bfloat16)
    shards = dict(arrays, raw=b"hello", ba=bytearray(b"\x00\x01\x02"), mv=memoryview(b"abcdef")[1:4],
                  t32=t32, tbf=tbf)
    address = daemon.address if transfer == "shared" else daemon.tcp_address
    with tierckpt.Client(address, transfer=transfer) as c:
        fut = c.save("job", 5, 0, 1, shards, metadata={"lr": 0.1, "note": "x"})
        res = fut.result(30)
        assert res.step == 5 and res.nbytes == sum(memoryview(v).nbytes if not isinstance(v, torch.Tensor)
                                                   else v.numel() * v.element_size() for v in shards.values())
        ck = c.restore("job", rank=0)
    assert (ck.step, ck.tier, ck.world_size, ck.metadata) == (5, "local", 1, {"lr": 0.1, "note": "x"})
    for name, arr in arrays.items():
        got = ck.shards[name]
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)
        assert not got.flags.writeable
    assert bytes(ck.shards["raw"]) == b"hello" and bytes(ck.shards["ba"]) == b"\x00\x01\x02"
    assert bytes(ck.shards["mv"]) == b"bcd"
    assert torch.equal(ck.tensor("t32"), t32) and torch.equal(ck.tensor("tbf"), tbf)
    assert ck.tensor("tbf").dtype == torch.bfloat16


def test_shared_and_stream_transfers_store_identical_bytes(daemon):
    arrays = _arrays(1)
    with tierckpt.Client(daemon.address) as shared, tierckpt.Client(daemon.tcp_address, transfer="stream") as stream:
        shared.save("a", 1, 0, 1, arrays).result(30)
        stream.save("b", 1, 0, 1, arrays).result(30)
        ck_a = shared.restore("a", 0)
        ck_b = stream.restore("a", 0)  # a streamed restore of a shared-fs save
    man_a = json.loads(next(daemon.local_dir.glob("jobs/a/*/*/manifest.json")).read_bytes())
    man_b = json.loads(next(daemon.local_dir.glob("jobs/b/*/*/manifest.json")).read_bytes())
    strip = lambda m: [(s["name"], s["size"], s["checksum"], s["dtype"], s["shape"]) for s in m["shards"]]  # noqa: E731
    assert strip(man_a) == strip(man_b)
    for name in arrays:
        np.testing.assert_array_equal(ck_a.shards[name], ck_b.shards[name])


def test_caller_may_overwrite_buffers_once_save_returns(daemon):
    big = np.full(8 << 20, 7, dtype=np.uint8)
    with daemon.client() as c:
        fut = c.save("job", 1, 0, 1, {"big": big})
        big[:] = 0  # before the commit has necessarily happened
        fut.result(30)
        assert fut.blocking_seconds > 0
        ck = c.restore("job", 0)
    assert int(ck.shards["big"].min()) == 7


def test_latest_and_list_need_every_rank(daemon):
    with daemon.client() as c:
        c.save("job", 10, 0, 2, {"x": b"r0"}).result(30)
        c.save("job", 10, 1, 2, {"x": b"r1"}).result(30)
        c.save("job", 20, 0, 2, {"x": b"r0"}).result(30)
        assert c.latest("job") == 10
        infos = {i.step: i for i in c.list("job")}
        assert infos[10].complete and not infos[20].complete
        assert [r.rank for r in infos[20].ranks] == [0]
        assert infos[10].ranks[1].nodes == ("node0",) and infos[10].tiers == ("local",)
        assert c.latest("other") is None
        with pytest.raises(tierckpt.NotFoundError):
            c.restore("other", 0)
        with pytest.raises(tierckpt.NotFoundError):
            c.restore("job", 1, step=20)  # rank 1 never saved step 20


def test_resave_replaces_atomically(daemon):
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": b"old", "gone": b"1"}).result(30)
        c.save("job", 1, 0, 1, {"x": b"new!"}).result(30)
        ck = c.restore("job", 0)
    assert set(ck.shards) == {"x"} and bytes(ck.shards["x"]) == b"new!"
    rank_dir = _committed_manifests(daemon)[0].parent
    assert len([p for p in rank_dir.iterdir() if p.name != "manifest.json"]) == 1  # old files removed


def test_keep_local_retention_keeps_newest_complete(daemon_factory):
    d = daemon_factory(args=("--keep-local", "2"))
    with d.client() as c:
        for step in (1, 2, 3, 4):
            c.save("job", step, 0, 1, {"x": np.full(1000, step, np.int32)}).result(30)
        c.save("job", 5, 0, 2, {"x": b"partial"}).result(30)  # in progress: world_size 2, one rank
        steps = [i.step for i in c.list("job")]
    assert steps == [3, 4, 5]


def test_capacity_exhausted_after_eviction_leaves_store_intact(daemon_factory):
    # Each rank is charged its data plus one 4096-byte manifest (local.rules.MIN_CHARGE).
    d = daemon_factory(args=("--local-capacity", "110000", "--keep-local", "5"))
    with d.client() as c:
        c.save("job", 1, 0, 1, {"x": np.zeros(10000, np.uint8)}).result(30)
        c.save("job", 2, 0, 1, {"x": np.zeros(40000, np.uint8)}).result(30)
        # Needs step 1 evicted (capacity may evict old complete steps, never the newest complete).
        c.save("job", 3, 0, 1, {"x": np.ones(55000, np.uint8)}).result(30)
        assert [i.step for i in c.list("job")] == [2, 3]
        with pytest.raises(tierckpt.CapacityError):
            c.save("job", 4, 0, 1, {"x": np.zeros(90000, np.uint8)})
        with pytest.raises(tierckpt.CapacityError, match="local_capacity"):
            c.save("job", 4, 0, 1, {"x": np.zeros(200000, np.uint8)})
        # Capacity is decided before evicting: neither save could fit even with step 2 gone
        # (3 is the newest complete), so nothing was evicted.
        assert [i.step for i in c.list("job")] == [2, 3]
        assert int(c.restore("job", 0).shards["x"].min()) == 1
        assert c.status().staging_bytes == 0


def test_corrupt_local_copy_raises_data_loss(daemon):
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": np.arange(4096, dtype=np.int32)}).result(30)
    data_file = next(p for p in _committed_manifests(daemon)[0].parent.iterdir() if p.name.startswith("x."))
    with open(data_file, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff")
    with daemon.client() as c:
        with pytest.raises(tierckpt.DataLossError, match="every copy failed|not held|checksum"):
            c.restore("job", 0)
    with tierckpt.Client(daemon.tcp_address, transfer="stream") as c:
        c.save("job2", 1, 0, 1, {"x": b"abc"}).result(30)
    f2 = next(p for p in daemon.local_dir.glob("jobs/job2/*/*/x.*"))
    f2.write_bytes(b"abd")
    with tierckpt.Client(daemon.tcp_address, transfer="stream") as c:
        with pytest.raises(tierckpt.DataLossError):
            c.restore("job2", 0)


def test_restart_keeps_committed_and_reclaims_staging(daemon):
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": b"committed"}).result(30)
    stub = pb_grpc.TierckptStub(grpc.insecure_channel(daemon.address))
    begun = stub.BeginSave(pb.BeginSaveRequest(job="job", step=2, rank=0, world_size=1,
                                               shards=[pb.ShardSpec(name="x", size=4)]))
    assert Path(begun.shards[0].path).exists()
    daemon.kill()  # SIGKILL mid-save
    daemon.start()
    assert not any((daemon.local_dir / "staging").iterdir())
    with daemon.client() as c:
        assert c.latest("job") == 1
        assert bytes(c.restore("job", 0).shards["x"]) == b"committed"


def test_client_killed_mid_save_leaves_nothing(daemon_factory):
    d = daemon_factory(args=("--staging-timeout", "1"))
    script = (
        "import sys, time, tierckpt\n"
        "from tierckpt.v1 import tierckpt_pb2 as pb\n"
        "c = tierckpt.Client(sys.argv[1])\n"
        "b = c._stub.BeginSave(pb.BeginSaveRequest(job='job', step=1, rank=0, world_size=1,"
        " shards=[pb.ShardSpec(name='x', size=1<<20)]))\n"
        "fd = open(b.shards[0].path, 'r+b'); fd.write(b'partial'); fd.flush()\n"
        "print('STAGED', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script, d.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline()
    p.send_signal(signal.SIGKILL)
    _, err = p.communicate()
    assert line.startswith(b"STAGED"), err.decode()
    wait_until(lambda: not any((d.local_dir / "staging").iterdir()), 60, "the staging area to be reclaimed")
    leftovers = list((d.local_dir / "staging").rglob("*"))
    assert not leftovers, f"{leftovers}\n{d.log_tail()}"
    assert not _committed_manifests(d)
    with d.client() as c:
        assert c.latest("job") is None and c.status().staging_bytes == 0


BAD_BEGIN = [
    (dict(job=""), "job"),
    (dict(job="../etc"), "job"),
    (dict(job="a/b"), "job"),
    (dict(job="a\x00b"), "job"),
    (dict(job="-lead"), "job"),
    (dict(rank=4, world_size=4), "rank"),
    (dict(world_size=0), "world_size"),
    (dict(shards=[pb.ShardSpec(name="..", size=1)]), "shards.name"),
    (dict(shards=[pb.ShardSpec(name="a/b", size=1)]), "shards.name"),
    (dict(shards=[pb.ShardSpec(name="", size=1)]), "shards.name"),
    (dict(shards=[pb.ShardSpec(name="x", size=2**62)]), "size"),
    (dict(shards=[pb.ShardSpec(name="x", size=1), pb.ShardSpec(name="x", size=1)]), "appears twice"),
    (dict(shards=[]), "shards"),
]


@pytest.mark.parametrize("override,field", BAD_BEGIN)
def test_bad_input_is_invalid_argument_and_touches_nothing(daemon, override, field):
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": b"keep"}).result(30)
    before = {p: p.read_bytes() for p in daemon.local_dir.rglob("*") if p.is_file() and p.name != ".fs-token"}
    stub = pb_grpc.TierckptStub(grpc.insecure_channel(daemon.address))
    req = dict(job="job", step=1, rank=0, world_size=1, shards=[pb.ShardSpec(name="x", size=1)])
    req.update(override)
    with pytest.raises(grpc.RpcError) as e:
        stub.BeginSave(pb.BeginSaveRequest(**req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    after = {p: p.read_bytes() for p in daemon.local_dir.rglob("*") if p.is_file() and p.name != ".fs-token"}
    assert after == before


def test_commit_without_begin_and_bad_digest(daemon):
    stub = pb_grpc.TierckptStub(grpc.insecure_channel(daemon.address))
    with pytest.raises(grpc.RpcError) as e:
        stub.CommitSave(pb.CommitSaveRequest(save_id="deadbeef", digests=[pb.ShardDigest(name="x", checksum="0" * 16)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "save_id" in e.value.details()
    begun = stub.BeginSave(pb.BeginSaveRequest(job="j", step=1, rank=0, world_size=1,
                                               shards=[pb.ShardSpec(name="x", size=1)]))
    for digests, field in (([], "digests"), ([pb.ShardDigest(name="x", checksum="zz")], "checksum")):
        with pytest.raises(grpc.RpcError) as e:
            stub.CommitSave(pb.CommitSaveRequest(save_id=begun.save_id, digests=digests))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.CommitSave(pb.CommitSaveRequest(save_id=begun.save_id, metadata_json="[1]",
                                             digests=[pb.ShardDigest(name="x", checksum="0" * 16)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "metadata_json" in e.value.details()


def test_client_validates_before_contacting_daemon(scratch):
    c = tierckpt.Client(f"unix://{scratch}/nothing.sock", timeout=2)
    with pytest.raises(tierckpt.InvalidArgumentError, match="job"):
        c.save("../x", 1, 0, 1, {"a": b"x"})
    with pytest.raises(tierckpt.InvalidArgumentError, match="rank"):
        c.save("j", 1, 3, 2, {"a": b"x"})
    with pytest.raises(tierckpt.InvalidArgumentError, match="step"):
        c.save("j", -1, 0, 1, {"a": b"x"})
    with pytest.raises(tierckpt.InvalidArgumentError, match="shards"):
        c.save("j", 1, 0, 1, {"a/b": b"x"})
    with pytest.raises(tierckpt.InvalidArgumentError, match="unsupported type"):
        c.save("j", 1, 0, 1, {"a": "a string"})
    with pytest.raises(tierckpt.InvalidArgumentError, match="metadata"):
        c.save("j", 1, 0, 1, {"a": b"x"}, metadata={"f": object()})
    with pytest.raises(tierckpt.UnavailableError):
        c.save("j", 1, 0, 1, {"a": b"x"})
    with pytest.raises(tierckpt.UnavailableError):
        c.latest("j")
    c.close()
    with pytest.raises(tierckpt.InvalidArgumentError, match="verify"):
        tierckpt.Client(f"unix://{scratch}/x.sock", verify="sometimes")
    with pytest.raises(tierckpt.InvalidArgumentError, match="transfer"):
        tierckpt.Client(f"unix://{scratch}/x.sock", transfer="carrier-pigeon")


def test_sigterm_exits_zero_and_removes_socket(daemon):
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": b"1"}).result(30)
    assert daemon.terminate() == 0
    assert not daemon.socket.exists()
    assert "shutdown complete" in daemon.log_tail()


def test_bad_config_is_one_line_and_nonzero(scratch):
    from tests.harness import _BIN_DIR

    for args, key in ((["--keep-local", "0"], "keep_local"), (["--peers", "bad"], "peers"),
                      (["--local-capacity", "lots"], "local_capacity")):
        p = subprocess.run([str(_BIN_DIR / "tierckptd"), "--local-dir", str(scratch / "d"), *args],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0]
    cfg = scratch / "c.toml"
    cfg.write_text('local_dir = "/tmp/x"\nbogus_key = 1\n')
    p = subprocess.run([str(_BIN_DIR / "tierckptd"), "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "bogus_key" in p.stderr


def test_writing_into_restored_tensor_never_changes_the_checkpoint(daemon):
    import torch

    t = torch.arange(1 << 16, dtype=torch.float32)
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"t": t}).result(30)
        view = c.restore("job", 0).tensor("t")
        view.add_(1)  # copy-on-write pages: no crash, and the stored file is untouched
        assert float(view[0]) == 1.0
        assert torch.equal(c.restore("job", 0).tensor("t"), t)


def test_second_daemon_on_the_same_local_dir_is_refused(daemon, scratch):
    from tests.harness import _BIN_DIR

    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": b"keep"}).result(30)
    p = subprocess.run([str(_BIN_DIR / "tierckptd"), "--local-dir", str(daemon.local_dir), "--socket",
                        str(scratch / "other.sock"), "--listen", "127.0.0.1:0", "--insecure-listen"],
                       capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and "local_dir" in p.stderr and "in use" in p.stderr
    with daemon.client() as c:
        assert bytes(c.restore("job", 0).shards["x"]) == b"keep"


def test_auto_transfer_falls_back_to_streaming_when_the_daemon_files_are_hidden(daemon):
    arr = np.arange(1000, dtype=np.int16)
    with tierckpt.Client(daemon.tcp_address) as c:
        c._sees = lambda local_dir, token: False  # as a trainer in another pod without the volume
        c.save("job", 1, 0, 1, {"a": arr}).result(30)
        assert c._fs_hidden
        c.save("job", 2, 0, 1, {"a": arr}).result(30)  # straight to streaming this time
        ck = c.restore("job", 0)
    assert ck.step == 2 and np.array_equal(ck.shards["a"], arr)
    assert not any((daemon.local_dir / "staging").iterdir())
