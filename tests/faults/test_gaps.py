"""One test per integrity gap the held-out fault matrix found (each failed before its fix)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from pathlib import Path

import grpc
import pytest
from tierckpt.common import checksum
from tierckpt.errors import DataLossError, TierError
from tierckpt.v1 import peer_pb2 as ppb
from tierckpt.v1 import tierckpt_pb2 as pb
from tierckptd.backends.file import FileBackend
from tierckptd.local.manifest import Manifest
from tierckptd.metrics import Metrics
from tierckptd.persistent import manifest_key
from tierckptd.persistent.layout import chunk_keys
from tierckptd.testing import free_port

from ..harness import Cluster, wait_until
from ..persistent.rig import Rig, until
from ._util import data_files, flip_bit, payload, rank_dir, save, shards_for, stored_shards, stubs

SIZES = {"model": 200_000, "optim": 12_345}
FAST = "--knobs=refresh_interval=0.2,down_retry_max=0.5"


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code()


# -- gap 1 (fixed on main): BeginSave checks dtype/shape against size; start-up quarantines

def test_gap1_layout_checked_and_a_bad_manifest_quarantined(daemon, matrix) -> None:
    ch, stub, _ = stubs(daemon.tcp_address)
    with ch:
        req = pb.BeginSaveRequest(job="j", step=1, rank=0, world_size=1,
                                  shards=[pb.ShardSpec(name="w", size=7, dtype="float32", shape=[4])])
        assert _code(lambda: stub.BeginSave(req, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    matrix.code("INVALID_ARGUMENT")
    with daemon.client() as c:
        save(c, "j", 1, 0, SIZES)
    (rank_dir(daemon.local_dir, "j", 1, 0) / "manifest.json").write_text('{"format": "nonsense"}')
    daemon.restart()
    assert not rank_dir(daemon.local_dir, "j", 1, 0).exists()
    kept = [p for p in (daemon.local_dir / "quarantine").rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in kept) and len(kept) >= 3, kept  # moved, not deleted


# -- gap 2: the drain hashes what it uploads; a corrupt local copy is never published

def test_gap2_drain_refuses_a_corrupt_local_copy_in_process(tmp_path: Path, matrix) -> None:
    async def body() -> None:
        metrics = Metrics()
        rig = Rig(tmp_path, metrics=metrics)
        man = rig.save("job", 1, 0, {"a": b"a" * 5000, "b": b"b" * 10})
        flip_bit(rig.store.shard_path(man, "a"), 4000)  # after the commit, before the drain
        await rig.tier.start()
        await until(lambda: rig.tier.ledger.pending[man.key].error, "the refused attempt")
        assert not [k for k in rig.memory.objects if "manifest" in k or k.endswith(f"a.{man.generation}")
                    or "/a" in k.split("rank-")[-1]], rig.memory.objects.keys()
        assert metrics.checksum_failures.labels(tier="local")._value.get() >= 1
        assert [m.generation for m in rig.host.repairs][:1] == [man.generation]  # a peer copy was asked for
        with pytest.raises(TierError, match="local copy corrupt"):  # wait("persistent") fails loudly
            await asyncio.wait_for(rig.tier.wait("job", 1, 0, None), 5)
        rig.save("job", 1, 0, {"a": b"A" * 5000, "b": b"B" * 10})  # a re-save drains
        await asyncio.wait_for(rig.tier.wait("job", 1, 0, None), 10)
        await rig.tier.stop(1.0)
    asyncio.run(body())
    matrix.record(committed=1, corrupt_returned=0)


def test_gap2_a_crashing_repair_refuses_the_drain_and_pauses(tmp_path: Path, matrix) -> None:
    """A repair that raises is a refused drain with the retry pause, not an attempt loop without one."""
    class CrashingHost:
        def __init__(self) -> None:
            self.calls = 0

        def notify_ingested(self, manifest: Manifest) -> None:
            pass

        async def repair_local(self, manifest: Manifest) -> bool:
            self.calls += 1
            raise RuntimeError("repair bug")

    async def body() -> None:
        rig = Rig(tmp_path)
        host = CrashingHost()
        rig.tier.bind(host)
        man = rig.save("job", 1, 0, {"a": b"a" * 5000})
        flip_bit(rig.store.shard_path(man, "a"), 10)
        await rig.tier.start()
        entry = await until(lambda: (e := rig.tier.ledger.pending[man.key]).error and e, "the refused attempt")
        assert entry.error.startswith("local copy corrupt") and not entry.running
        assert entry.not_before > time.monotonic() and host.calls == 1
        await rig.tier.stop(1.0)
    asyncio.run(body())
    matrix.record(committed=1, corrupt_returned=0)


def test_gap2_drain_of_a_corrupt_local_copy_uses_a_peer_copy(daemon_factory, tmp_path: Path, matrix) -> None:
    store = tmp_path / "store"
    cl = Cluster(daemon_factory, 2, replicas=1,
                 extra=("--persistent", f"file://{store}", "--persist-every", "1",
                        FAST + ",debug_drain_delay=15,failed_retry_seconds=1"))
    n0 = cl.d["n0"]
    with n0.client() as c:
        fut = save(c, "job", 1, 0, SIZES)
        fut.wait("peer", timeout=60)
        # The drain's first attempt waits debug_drain_delay after the commit: room for the
        # replica and the flip on a loaded machine (the test only waits it out once).
        flip_bit(data_files(n0.local_dir, "job", 1, 0)[0], 100)
        assert fut.wait("persistent", timeout=90)
    assert stored_shards(store, "job", 1, 0) == shards_for("job", 1, 0, SIZES)  # the verified peer copy was drained
    assert "checksum" in n0.log_text() and "peer copy" in n0.log_text()
    matrix.record(committed=1)


# -- gap 3: a persistent object whose size disagrees with its manifest is DataLoss, not UNKNOWN

@pytest.mark.parametrize("change", ["shorter", "longer"])
def test_gap3_object_size_disagreeing_with_manifest_is_data_loss(tmp_path: Path, change: str, matrix) -> None:
    async def body() -> None:
        writer = Rig(tmp_path, node_id="a")
        await writer.tier.start()
        writer.save("job", 3, 0, {"model": bytes(range(256)) * 40})
        await asyncio.wait_for(writer.tier.wait("job", 3, 0, None), 10)
        await writer.tier.stop(1.0)
        man = Manifest.from_json(writer.memory.objects[manifest_key("job", 3, 0, 1)])
        key = chunk_keys("job", man.shard("model"))[0]  # its one chunk
        data = writer.memory.objects[key]
        writer.memory.objects[key] = data[:-100] if change == "shorter" else data + b"x" * 100
        reader = Rig(tmp_path, node_id="b", memory=writer.memory)
        await reader.tier.start()
        with pytest.raises(DataLossError):
            await reader.tier.fetch("job", 3, 0)
        assert reader.store.get("job", 3, 0) is None
        await reader.tier.stop(1.0)
    asyncio.run(body())
    matrix.record(typed=1)


# -- gap 4: well-formed bad requests get INVALID_ARGUMENT, never UNKNOWN

def test_gap4_bad_requests_are_invalid_argument(daemon_factory, matrix) -> None:
    port = free_port()
    d = daemon_factory("n0", port=port, args=("--peers", f"n0=127.0.0.1:{port},n1=127.0.0.1:{free_port()}"))
    ch, stub, peer = stubs(d.tcp_address)
    with ch:
        cases = {
            "nested metadata": lambda: stub.CommitSave(pb.CommitSaveRequest(
                save_id="x", metadata_json="[" * 100_000 + "]" * 100_000), timeout=10),
            "huge metadata": lambda: stub.CommitSave(pb.CommitSaveRequest(
                save_id="x", metadata_json='{"a": "' + "x" * (2 << 20) + '"}'), timeout=10),
            "manifest not an object": lambda: peer.PrepareReplica(ppb.PrepareReplicaRequest(
                sender="n1", manifest_json="[1, 2]"), timeout=10),
            "manifest shards not objects": lambda: peer.PrepareReplica(ppb.PrepareReplicaRequest(
                sender="n1", manifest_json='{"shards": [[1]]}'), timeout=10),
            "nested manifest": lambda: peer.PrepareReplica(ppb.PrepareReplicaRequest(
                sender="n1", manifest_json="[" * 100_000), timeout=10),
            "timeout NaN": lambda: stub.WaitTier(pb.WaitTierRequest(
                job="j", step=1, rank=0, tier=pb.TIER_LOCAL, timeout_seconds=float("nan")), timeout=10),
            "timeout inf": lambda: stub.WaitTier(pb.WaitTierRequest(
                job="j", step=1, rank=0, tier=pb.TIER_PEER, timeout_seconds=float("inf")), timeout=10),
            "undecodable Status": lambda: ch.unary_unary("/tierckpt.v1.Tierckpt/Status")(b"\xff\xff\xff", timeout=10),
            "undecodable Catalog": lambda: ch.unary_unary("/tierckpt.v1.Peer/Catalog")(b"\x0a\x05ab", timeout=10),
            "undecodable ReadShard": lambda: list(ch.unary_stream("/tierckpt.v1.Tierckpt/ReadShard")(
                b"\x12\x02\xff\xfe", timeout=10)),
            "undecodable WriteShard": lambda: ch.stream_unary("/tierckpt.v1.Tierckpt/WriteShard")(
                iter([b"\x0a\x01\xff"]), timeout=10),
        }
        got = {name: _code(fn) for name, fn in cases.items()}
    for code in got.values():
        matrix.code(code.name)
    matrix.record(typed=sum(c == grpc.StatusCode.INVALID_ARGUMENT for c in got.values()))
    assert got == dict.fromkeys(cases, grpc.StatusCode.INVALID_ARGUMENT), got
    assert d.alive()


# -- gap 5

def test_gap5_stale_upload_temporaries_are_swept(daemon_factory, tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "job" / "data").mkdir(parents=True)
    stale = store / "job" / "data" / "x.tierckpt-tmp-0badf00d"
    fresh = store / "job" / "data" / "y.tierckpt-tmp-00c0ffee"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"in flight")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert FileBackend(str(store)).remove_stale_temporaries(3600) == 1
    assert not stale.exists() and fresh.exists()
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    daemon_factory("n0", args=("--persistent", f"file://{store}"))
    wait_until(lambda: not stale.exists(), 60, "the start-up sweep")
    assert fresh.exists()


def test_gap5_stream_client_falls_back_to_a_peer_copy(daemon_factory, matrix) -> None:
    import tierckpt

    cl = Cluster(daemon_factory, 2, replicas=1, extra=(FAST,))
    n0 = cl.d["n0"]
    with n0.client() as c:
        save(c, "job", 4, 0, SIZES).wait("peer", timeout=30)
    flip_bit(data_files(n0.local_dir, "job", 4, 0)[-1], 7)
    with tierckpt.Client(n0.tcp_address, transfer="stream") as c:
        ck = c.restore("job", rank=0, step=4)
        assert ck.tier == "peer"
        assert {n: bytes(v) for n, v in ck.shards.items()} == shards_for("job", 4, 0, SIZES)
    matrix.record(committed=1)


def test_gap5_a_local_copy_reported_corrupt_is_verified_before_it_is_dropped(daemon, matrix) -> None:
    with daemon.client() as c:
        save(c, "job", 2, 0, SIZES)
    gen = json.loads((rank_dir(daemon.local_dir, "job", 2, 0) / "manifest.json").read_text())["generation"]
    ch, stub, _ = stubs(daemon.tcp_address)
    with ch:
        req = pb.RestoreRequest(job="job", rank=0, has_step=True, step=2, local_corrupt=True,
                                corrupt_generation=gen, transfer=pb.TRANSFER_STREAM)
        resp = stub.Restore(req, timeout=30)  # a false report: the copy verifies, it is kept
        assert resp.tier == pb.TIER_LOCAL
        flip_bit(data_files(daemon.local_dir, "job", 2, 0)[0], 3)
        assert _code(lambda: stub.Restore(req, timeout=30)) in (grpc.StatusCode.DATA_LOSS,
                                                                 grpc.StatusCode.NOT_FOUND)
    assert not rank_dir(daemon.local_dir, "job", 2, 0).joinpath("manifest.json").exists()
    matrix.record(committed=1, typed=1)


def _bulk_msg(sock: socket.socket, doc: dict) -> None:
    data = json.dumps(doc).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _prepare(peer, owner: str, size: int, timeout: float = 10) -> tuple[str, int]:
    data = payload("rj", 1, 0, "w", size)
    man = {"format": 1, "checksum_algorithm": checksum.ALGORITHM, "job": "rj", "step": 1, "rank": 0,
           "world_size": 1, "node": owner, "generation": "g1", "metadata_json": "{}", "created": time.time(),
           "shards": [{"name": "w", "size": size, "checksum": checksum.digest(data), "dtype": "", "shape": []}]}
    resp = peer.PrepareReplica(ppb.PrepareReplicaRequest(sender=owner, manifest_json=json.dumps(man)), timeout=timeout)
    return resp.ticket, resp.bulk_port


def _node_with_an_absent_peer(daemon_factory, knobs: str):
    """n0 of a two-node ring whose n1 never starts (n0 accepts replicas addressed from n1)."""
    port = free_port()
    return daemon_factory("n0", port=port, args=("--peers", f"n0=127.0.0.1:{port},n1=127.0.0.1:{free_port()}",
                                                 f"--knobs={knobs}"))


@pytest.mark.parametrize("how", ["connection breaks", "sender goes quiet"])
def test_gap5_a_dead_senders_partial_replica_is_dropped(daemon_factory, how: str) -> None:
    d = _node_with_an_absent_peer(daemon_factory, "refresh_interval=0.2,inbound_idle_timeout=1")
    staging = d.local_dir / "staging"
    ch, _, peer = stubs(d.tcp_address)
    with ch:
        from tierckptd.local.manifest import FORMAT
        assert FORMAT == 1
        ticket, port = _prepare(peer, "n1", 1 << 20)
    assert any(staging.iterdir())
    if how == "connection breaks":
        s = socket.create_connection(("127.0.0.1", port))
        _bulk_msg(s, {"v": 1, "op": "put", "ticket": ticket, "shard": "w", "offset": 0, "chunk": 1 << 20,
                      "stride": 1 << 20})
        s.recv(64)
        s.sendall(b"\0" * 1000)
        s.close()  # the sender died mid-piece
    # Dropped within a minute: not kept until the staging timeout (10 minutes).
    wait_until(lambda: not any(staging.iterdir()), 60, "the partial replica to be dropped")
    assert d.alive()


@pytest.mark.parametrize("rpc", ["BeginSave", "PrepareReplica"])
def test_gap5_a_caller_gone_while_staging_opens_leaves_nothing_staged(daemon_factory, rpc: str) -> None:
    """The caller's deadline passes (or it is killed) while the daemon creates the staging area:
    the area is dropped as soon as it exists, not kept until the staging timeout."""
    d = _node_with_an_absent_peer(daemon_factory, "debug_begin_delay=5,inbound_idle_timeout=0")
    staging = d.local_dir / "staging"
    ch, stub, peer = stubs(d.tcp_address)
    with ch:
        if rpc == "BeginSave":
            call = lambda: stub.BeginSave(pb.BeginSaveRequest(job="cj", step=1, rank=0, world_size=1,  # noqa: E731
                                                              shards=[pb.ShardSpec(name="w", size=4096)]), timeout=0.3)
        else:
            call = lambda: _prepare(peer, "n1", 4096, timeout=0.3)  # noqa: E731
        assert _code(call) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: staging.exists() and any(staging.iterdir()), 60, "the staging area to be created")
    # Dropped within a minute: not kept until the staging timeout (10 minutes).
    wait_until(lambda: not any(staging.iterdir()), 60, "the orphaned staging area to be dropped")
