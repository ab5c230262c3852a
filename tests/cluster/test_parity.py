"""Parity redundancy (``--redundancy parity:4+1``) with real daemons on loopback: a 5-node group
survives the loss of any one node with 1 + 1/4 of the memory; two lost nodes fall back to the
persistent tier; a corrupt parity slot is detected and never yields wrong bytes."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import tierckpt
from tierckpt.common import checksum as _checksum
from tierckptd.config import ConfigError, parse_args
from tierckptd.parity import layout
from tierckptd.parity.xor import xor_into

from ..harness import Cluster, wait_until

PARITY = ("--redundancy", "parity:4+1")


def shard(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


# ------------------------------------------------------------------------------ rules (pure)

def test_layout_groups_protectors_and_chunks():
    nodes = [f"n{i}" for i in range(11)]
    assert layout.groups(nodes, 5) == [["n0", "n1", "n10", "n2", "n3"], ["n4", "n5", "n6", "n7", "n8", "n9"]]
    assert layout.protectors("n1", nodes, 5) == ["n10", "n2", "n3", "n0"]  # ring order after n1, in its group
    assert layout.chunk_of("n0", "n1", nodes, 5) == 3 and layout.chunk_of("n4", "n1", nodes, 5) is None
    spans = [layout.chunk_span(10, 4, c) for c in range(4)]
    assert spans == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert [layout.chunk_span(2, 4, c) for c in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    # every node protects one chunk of each other member, and none of its own
    g = ["a", "b", "c", "d", "e"]
    for owner in g:
        prot = layout.protectors(owner, g, 5)
        assert sorted(prot) == sorted(set(g) - {owner})


def test_xor_recovers_any_one_block():
    blocks = [shard(i, 1000 + 7 * i) for i in range(4)]
    parity = np.zeros(max(len(b) for b in blocks), np.uint8)
    for b in blocks:
        xor_into(parity, b)
    for lost in range(4):
        rec = parity.copy()
        for i, b in enumerate(blocks):
            if i != lost:
                xor_into(rec, b)
        assert bytes(rec[:len(blocks[lost])]) == bytes(blocks[lost])


def test_redundancy_option_is_validated_naming_the_field():
    cfg = parse_args(["--redundancy", "parity:4+1", "--replicas", "2"])
    assert cfg.parity == (4, 1) and cfg.replicas == 0  # parity replaces the full copies
    assert parse_args([]).parity is None and parse_args([]).redundancy == "replicas"
    for bad in ("parity:30+3", "parity:0+1", "raid5", "parity:4"):
        with pytest.raises(ConfigError, match="^redundancy: "):
            parse_args(["--redundancy", bad])


# ------------------------------------------------------------------------------ real daemons

def _save_all(cl: Cluster, job: str, step: int, world: int, sizes: list[int],
              also: str = "") -> dict[int, dict[str, str]]:
    """Rank r saved on node n{r % 5}, two shards each, all at once; then wait('peer') on each (the
    protectors take the chunks concurrently). Returns the checksums."""
    sums: dict[int, dict[str, str]] = {}
    clients, futs = [], []
    try:
        for rank in range(world):
            node = cl.ids[rank % len(cl.ids)]
            c = cl.d[node].client()
            clients.append(c)
            a, b = shard(step * 100 + rank, sizes[rank]), shard(step * 100 + rank + 50, 333 + rank)
            sums[rank] = {"a": _checksum.digest(a), "b": _checksum.digest(b)}
            futs.append((node, c.save(job, step, rank, world, {"a": a, "b": b}, metadata={"rank": rank})))
        for node, fut in futs:
            assert sorted(fut.wait("peer", timeout=90)) == sorted(set(cl.ids) - {node})  # its four protectors
            if also:
                fut.wait(also, timeout=90)
    finally:
        for c in clients:
            c.close()
    return sums


def _parity_bytes(d) -> int:
    return sum(p.stat().st_size for p in (d.local_dir / "parity").rglob("slot-*.bin"))


def _data_bytes(d) -> int:
    return sum(p.stat().st_size for p in (d.local_dir / "jobs").rglob("*") if p.is_file()
               and not p.name.endswith(".json") and "manifest" not in p.name)


def test_one_node_lost_every_rank_restored_exactly_with_a_quarter_more_memory(daemon_factory):
    cl = Cluster(daemon_factory, 5, replicas=0, extra=PARITY)
    job, world = "par", 5
    sizes = [400_000 + 9_973 * r for r in range(world)]
    sums = _save_all(cl, job, 7, world, sizes)
    # memory: no full copies anywhere; parity ~ 1/4 of a node's own data
    for n in cl.ids:
        d = cl.d[n]
        assert not any(p.name.startswith("rank-") and p.name != f"rank-{int(n[1:]):07d}"
                       for p in (d.local_dir / "jobs" / job).rglob("rank-*"))
        own = sizes[int(n[1:])] + 333 + int(n[1:])
        parity = _parity_bytes(d)
        assert 0 < parity <= -(-max(s + 338 for s in sizes) // 4) + 8, (n, parity)
        assert (own + parity) / own < 1.3
    victim = "n2"
    cl.replace(victim)  # kill -9 and wipe
    cl.wait_peers(victim)
    with cl.d[victim].client() as c:
        assert c.latest(job) == 7  # the lost rank is listed through its parity
        ck = c.restore(job, 2)
        assert ck.step == 7 and ck.tier == "peer"
        assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[2]
        assert ck.metadata == {"rank": 2}
    assert "reconstructed par step 7 rank 2 from parity" in cl.d[victim].log_text()
    # every other rank is still restorable on the replaced node too (full copies from their owners)
    with cl.d[victim].client() as c:
        for rank in (0, 4):
            ck = c.restore(job, rank)
            assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[rank]
    # the replaced node's lost parity is rebuilt by its group (its instance changed: catch-up)
    wait_until(lambda: _parity_bytes(cl.d[victim]) > 0, timeout=90, what="parity re-protected on the new node")


def test_two_nodes_lost_restore_comes_from_the_persistent_tier(daemon_factory, scratch: Path):
    bucket = scratch / "bucket"
    cl = Cluster(daemon_factory, 5, replicas=0, extra=(*PARITY, "--persistent", f"file://{bucket}",
                                                         "--persist-every", "1"))
    job, world = "par2", 5
    sums = _save_all(cl, job, 3, world, [200_000] * world, also="persistent")
    cl.d["n3"].kill()
    cl.replace("n1")
    with cl.d["n1"].client() as c:
        ck = c.restore(job, 1, step=3)
        assert ck.tier == "persistent"
        assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[1]


def test_corrupt_parity_is_detected_and_never_restored(daemon_factory):
    cl = Cluster(daemon_factory, 5, replicas=0, extra=PARITY)
    job, world = "parc", 5
    _save_all(cl, job, 4, world, [100_000] * world)
    # flip a byte in every parity slot protecting n0's rank 0 (its four protectors)
    flipped = 0
    for n in cl.ids[1:]:
        for meta in (cl.d[n].local_dir / "parity").rglob("slot-*.json"):
            doc = json.loads(meta.read_text())
            if any(m["node"] == "n0" for m in doc["members"]):
                data = meta.with_suffix(".bin")
                buf = bytearray(data.read_bytes())
                buf[len(buf) // 2] ^= 0xFF
                data.write_bytes(bytes(buf))
                flipped += 1
    assert flipped == 4
    cl.replace("n0")
    cl.wait_peers("n0")
    with cl.d["n0"].client() as c:
        with pytest.raises(tierckpt.DataLossError, match="fails its checksum"):
            c.restore(job, 0, step=4)
    assert "parity slot of parc step 4 on" in cl.d["n0"].log_text()
    assert not (cl.d["n0"].local_dir / "jobs" / job).exists() or not list((cl.d["n0"].local_dir / "jobs" / job).rglob(
        "rank-0000000"))  # nothing committed


def test_one_corrupt_slot_falls_back_to_the_persistent_tier(daemon_factory, scratch: Path):
    bucket = scratch / "bucket"
    cl = Cluster(daemon_factory, 5, replicas=0, extra=(*PARITY, "--persistent", f"file://{bucket}",
                                                         "--persist-every", "1"))
    job, world = "parf", 5
    sums = _save_all(cl, job, 2, world, [150_000] * world, also="persistent")
    meta = next(m for m in (cl.d["n3"].local_dir / "parity").rglob("slot-*.json")
                if any(x["node"] == "n0" for x in json.loads(m.read_text())["members"]))
    data = meta.with_suffix(".bin")
    buf = bytearray(data.read_bytes())
    buf[7] ^= 0x01
    data.write_bytes(bytes(buf))
    cl.replace("n0")
    cl.wait_peers("n0")
    with cl.d["n0"].client() as c:
        ck = c.restore(job, 0, step=2)
        assert ck.tier == "persistent"
        assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[0]
    assert "parity slot of parf step 2 on n3 fails its checksum" in cl.d["n0"].log_text()


def test_retention_drops_the_parity_of_evicted_steps(daemon_factory):
    cl = Cluster(daemon_factory, 5, replicas=0, extra=(*PARITY, "--keep-local", "1"))
    job, world = "parr", 5
    _save_all(cl, job, 1, world, [50_000] * world)

    def steps_with_parity() -> set[int]:
        return {int(p.name) for n in cl.ids for p in (cl.d[n].local_dir / "parity" / job).glob("0*")}

    assert steps_with_parity() == {1}
    _save_all(cl, job, 2, world, [50_000] * world)
    wait_until(lambda: steps_with_parity() == {2}, timeout=60, what="step 1's parity dropped after its eviction")
    with cl.d["n1"].client() as c:
        assert c.latest(job) == 2


def test_a_lost_nodes_rank_is_reconstructed_on_another_node(daemon_factory):
    """Restart elsewhere: n3 is gone for good; n0 (a member of its group) restores n3's rank."""
    cl = Cluster(daemon_factory, 5, replicas=0, extra=PARITY)
    job, world = "pare", 5
    sums = _save_all(cl, job, 9, world, [123_457] * world)
    cl.d["n3"].kill()
    with cl.d["n0"].client() as c:
        ck = c.restore(job, 3, step=9)
        assert ck.tier == "peer"
        assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[3]
        assert c.restore(job, 0, step=9).tier == "local"


def _full_slots(d) -> int:
    """Parity slots on ``d`` that protect all four members of their stripe."""
    full = 0
    for m in (d.local_dir / "parity").rglob("slot-*.json"):
        with contextlib.suppress(FileNotFoundError, ValueError):  # (a slot being rewritten)
            full += len(json.loads(m.read_text())["members"]) == 4
    return full


def test_parity_lost_on_a_protector_is_protected_again(daemon_factory):
    """A slot caught mid-XOR by a crash is dropped at start-up, and a step's parity dropped on a
    protector is noticed at the next audit: the owners protect their chunks again."""
    import grpc
    from tierckpt.v1 import peer_pb2 as ppb
    from tierckpt.v1 import peer_pb2_grpc as ppb_grpc

    cl = Cluster(daemon_factory, 5, replicas=0, extra=(*PARITY, "--knobs", "catch_up_interval=2"))
    job, world = "parl", 5
    sums = _save_all(cl, job, 6, world, [77_777] * world)
    # n1 crashes while its slot is being written: dropped at start-up, then rebuilt by its members
    cl.d["n1"].kill()
    meta = next((cl.d["n1"].local_dir / "parity").rglob("slot-*.json"))
    doc = json.loads(meta.read_text())
    meta.write_text(json.dumps({**doc, "pending": True}))
    cl.start("n1")
    cl.wait_peers("n1")
    wait_until(lambda: _parity_bytes(cl.d["n1"]) > 0, timeout=60, what="n1's slot rebuilt after the crash")
    assert "was being written at a crash: dropped" in cl.d["n1"].log_text()
    # the step's parity dropped on n2 behind its members' backs: the audit notices
    with grpc.insecure_channel(f"127.0.0.1:{cl.ports['n2']}") as ch:
        removed = ppb_grpc.PeerStub(ch).DropParity(ppb.DropParityRequest(requester="n0", job=job, step=6), timeout=10)
    assert removed.removed == 1 and _parity_bytes(cl.d["n2"]) == 0
    wait_until(lambda: _parity_bytes(cl.d["n2"]) > 0, timeout=60, what="n2's slot protected again after the audit")
    for n in ("n1", "n2"):  # a slot holds bytes as soon as its first member is back: wait for all four
        wait_until(lambda n=n: _full_slots(cl.d[n]) == 1, timeout=60, what=f"all four members back in {n}'s slot")
    assert "is no longer on n2: protecting it again" in cl.d["n0"].log_text()
    cl.replace("n3")
    cl.wait_peers("n3")
    with cl.d["n3"].client() as c:
        ck = c.restore(job, 3, step=6)
        assert {n: _checksum.digest(np.asarray(ck.shards[n])) for n in ("a", "b")} == sums[3]
