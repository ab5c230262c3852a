"""Peer tier: placement, replication, catalog across nodes, restore after node replacement, faults.

Integration tests run 2-4 real daemons as subprocesses on loopback (ports reserved up front so
that every daemon knows its peers before start-up).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import numpy as np
import pytest
import tierckpt
from tierckpt.common import checksum as _checksum
from tierckptd.cluster.ring import placement as ring_placement
from tierckptd.peer import plan_pieces
from tierckptd.peer.bulk import OrderedHasher, runs

from .harness import Cluster, Daemon, free_port, wait_until
from .threads import Checked, join_all

# ------------------------------------------------------------------------------ planning (pure)

def test_ring_placement_is_next_up_nodes_on_the_sorted_ring():
    nodes = ["n3", "n0", "n2", "n1"]
    assert ring_placement("n1", nodes, {"n0", "n2", "n3"}, 1) == ["n2"]
    assert ring_placement("n1", nodes, {"n0", "n2", "n3"}, 2) == ["n2", "n3"]
    assert ring_placement("n3", nodes, {"n0", "n1", "n2"}, 2) == ["n0", "n1"]  # wraps around
    assert ring_placement("n1", nodes, {"n0", "n3"}, 1) == ["n3"]  # n2 down: skipped
    assert ring_placement("n1", nodes, {"n1"}, 1) == []  # never the owner
    assert ring_placement("x", ["n0"], {"n0"}, 3) == ["n0"]  # fewer nodes than replicas


def test_plan_pieces_interleaves_large_shards_only_when_streams_would_idle():
    gib, mib = 1 << 30, 1 << 20
    assert plan_pieces([("a", gib)], 4, chunk=4 * mib) == [("a", j * 4 * mib, 4 * mib, 16 * mib) for j in range(4)]
    many = plan_pieces([("a", gib), ("b", 10), ("c", 0), ("d", gib)], 4)
    assert sorted(many) == [("a", 0, gib, gib), ("b", 0, 10, 10), ("c", 0, 1, 1), ("d", 0, gib, gib)]
    assert plan_pieces([("a", 40 * mib), ("b", 5)], 4, min_piece=32 * mib) == [("a", 0, 40 * mib, 40 * mib),
                                                                                 ("b", 0, 5, 5)]
    # Every byte of a shard is covered exactly once by the runs of its pieces.
    size = 300 * mib + 7
    pieces = plan_pieces([("a", size)], 3, min_piece=mib, chunk=4 * mib)
    covered = sorted(r for _, o, c, st in pieces for r in runs(o, c, st, size))
    assert len(pieces) == 3 and covered[0][0] == 0 and sum(n for _, n in covered) == size
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(covered))
    assert list(runs(0, 1, 1, 0)) == [(0, 0)]


def test_ordered_hasher_matches_the_shard_checksum_whatever_the_arrival_order():
    data = os.urandom(10 * 4096 + 5)
    h = OrderedHasher(len(data))
    chunks = list(runs(0, 4096, 4096, len(data)))
    threads = [Checked(h.update, o, data[o:o + n]) for o, n in reversed(chunks)]
    for t in threads:
        t.start()
    join_all(threads)
    assert h.complete and h.hexdigest() == _checksum.digest(data)
    h.abort("broken")
    assert not h.complete
    with pytest.raises(ConnectionError, match="broken"):
        h.update(len(data), b"")


# ------------------------------------------------------------------------------ helpers

def shard(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def rank_files(daemon: Daemon, job: str, step: int, rank: int) -> list[Path]:
    rdir = daemon.local_dir / "jobs" / job / f"{step:020d}" / f"rank-{rank:07d}"
    return sorted(p for p in rdir.iterdir() if p.name != "manifest.json")


# ------------------------------------------------------------------------------ integration

@pytest.mark.slow
def test_node_replacement_restores_every_rank_byte_for_byte(daemon_factory):
    cl = Cluster(daemon_factory, 4)
    job, world = "train", 4
    big = 130 << 20  # > 2 * MIN_PIECE: travels as two pieces, verified after arrival
    data = {(s, r): {"w": shard(100 * s + r, 3_000_000 + r), "opt": shard(7 + r, 1000)}
            for s in (1, 2) for r in range(4)}
    data[(2, 1)]["w"] = shard(99, big)
    for step in (1, 2):
        for rank, node in enumerate(cl.ids):  # rank i is saved on node i
            with cl.d[node].client() as c:
                fut = c.save(job, step, rank, world, data[(step, rank)], metadata={"step": step})
                fut.result(timeout=60)
                nxt = cl.ids[(rank + 1) % 4]
                assert fut.wait("peer", timeout=60) == [nxt]  # placement: the next id on the ring
    # Catalog across nodes, from any node: every rank on its owner and its ring successor.
    assert cl.holders("n3", job, 2) == {r: tuple(sorted({cl.ids[r], cl.ids[(r + 1) % 4]})) for r in range(4)}

    cl.d["n1"].kill()
    with cl.d["n0"].client() as c:
        wait_until(lambda: not next(p for p in c.status().peers if p.node_id == "n1").up, what="n1 down on n0")
        assert c.latest(job) == 2  # rank 1 is still held by n2
    cl.replace("n1")
    with cl.d["n1"].client() as c:
        assert c.latest(job) == 2  # an empty node finds the latest step from its peers
        ck = c.restore(job, 1)
        assert (ck.step, ck.tier, ck.metadata) == (2, "peer", {"step": 2})
        for name, arr in data[(2, 1)].items():
            assert np.array_equal(ck.shards[name], arr)
        for rank in range(world):  # every rank of the latest step, on the replacement node
            ck = c.restore(job, rank)
            assert ck.step == 2 and ck.tier in ("local", "peer")
            for name, arr in data[(2, rank)].items():
                assert np.array_equal(ck.shards[name], arr), (rank, name)
    for rank, node in enumerate(cl.ids):  # and every rank on its own node
        with cl.d[node].client() as c:
            ck = c.restore(job, rank)
            assert ck.step == 2 and all(np.array_equal(ck.shards[n], a) for n, a in data[(2, rank)].items())
    # Redundancy restored: the fetched copy is local on n1; n0 caught n1 up with its replica of rank 0.
    held = wait_until(lambda: (h := cl.holders("n2", job, 2)) and "n1" in h[0] and h, what="n0 catches n1 up")
    assert "n1" in held[1] and "n2" in held[1]
    # keep_local (2) counts cluster-wide completeness: no node holds all 4 ranks of a step, yet
    # step 1 is evicted everywhere once steps 2 and 3 are complete across the cluster.
    for rank, node in enumerate(cl.ids):
        with cl.d[node].client() as c:
            assert c.save(job, 3, rank, world, {"w": shard(300 + rank, 1000)}).wait("peer", timeout=60)
    with cl.d["n2"].client() as c:
        wait_until(lambda: [i.step for i in c.list(job)] == [2, 3], what="step 1 evicted on every node")


@pytest.mark.slow
def test_peer_down_during_save_then_catch_up_and_retention(daemon_factory):
    cl = Cluster(daemon_factory, 3, extra=("--keep-local", "1"))
    job = "j"
    cl.d["n1"].kill()  # n0's preferred placement
    a = shard(1, 2_000_000)
    with cl.d["n0"].client() as c:
        fut = c.save(job, 1, 0, 1, {"a": a})
        fut.result(timeout=30)
        assert fut.wait("peer", timeout=60) == ["n2"]  # retried, then the next node on the ring
    assert cl.holders("n0", job, 1) == {0: ("n0", "n2")}
    cl.start("n1")  # comes back with its data: caught up, the fallback copy becomes surplus
    wait_until(lambda: cl.holders("n0", job, 1) == {0: ("n0", "n1")}, timeout=30, what="catch-up + surplus GC")
    # Replicas follow the owner's retention (keep_local=1): step 1 disappears everywhere.
    with cl.d["n0"].client() as c:
        fut = c.save(job, 2, 0, 1, {"a": shard(2, 1000)})
        assert fut.wait("peer", timeout=60) == ["n1"]
        wait_until(lambda: [i.step for i in c.list(job)] == [2], what="step 1 dropped on every node")
        assert cl.holders("n2", job, 2) == {0: ("n0", "n1")}
        st = c.status()
        assert {p.node_id: p.up for p in st.peers} == {"n1": True, "n2": True}
        assert all(p.address.startswith("127.0.0.1:") and p.last_seen_unix > 0 for p in st.peers)


@pytest.mark.slow
def test_corrupt_replica_falls_back_to_the_next_copy(daemon_factory):
    cl = Cluster(daemon_factory, 3, replicas=2)
    job = "c"
    arrs = {"x": shard(5, 4_000_000), "y": shard(6, 10), "empty": shard(7, 0)}
    with cl.d["n0"].client() as c:
        fut = c.save(job, 7, 0, 1, arrs)
        assert fut.wait("peer", timeout=60) == ["n1", "n2"]
    victim = max(rank_files(cl.d["n1"], job, 7, 0), key=lambda p: p.stat().st_size)  # n1 is tried first
    with open(victim, "r+b") as fh:
        fh.seek(1000)
        b = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([b[0] ^ 0xFF]))
    cl.replace("n0")
    with cl.d["n0"].client() as c:
        ck = c.restore(job, 0)
        assert ck.tier == "peer" and ck.step == 7
        assert all(np.array_equal(ck.shards[n], a) for n, a in arrs.items())
    assert "checksum mismatch" in cl.d["n0"].log_text()
    # An unreachable copy falls back too: with n2 gone, n1's copy... is corrupt, so nothing is left.
    cl.d["n2"].kill()
    cl.replace("n0")
    with cl.d["n0"].client() as c, pytest.raises(tierckpt.errors.DataLossError, match="n1"):
        c.restore(job, 0, step=7)


@pytest.mark.slow
def test_wait_peer_raises_naming_the_failed_peer(daemon_factory):
    cl = Cluster(daemon_factory, 2)
    cl.d["n1"].kill()
    with cl.d["n0"].client() as c:
        fut = c.save("w", 1, 0, 1, {"a": b"x" * 100})
        fut.result(timeout=30)  # the local commit never waits for peers
        with pytest.raises(tierckpt.errors.TierError, match=r"0 of 1 peer copies.*n1"):
            fut.wait("peer", timeout=60)
    assert os.path.exists(cl.d["n0"].local_dir)


@pytest.mark.slow
def test_peers_dns_discovers_node_ids_by_asking_each_address(daemon_factory):
    # A headless Service resolves to every pod's address on one port; here two loopback
    # addresses (IP literals resolve to themselves) stand in for two pods.
    port = free_port()
    hosts = {"n0": "127.0.0.1", "n1": "127.0.0.2"}
    other = {"n0": "n1", "n1": "n0"}
    d = {n: daemon_factory(n, port=port, args=("--listen", f"{h}:{port}", "--peers-dns",
                                                f"{hosts[other[n]]}:{port}", "--replicas", "1"))
         for n, h in hosts.items()}
    with d["n0"].client() as c:
        want = [("n1", f"127.0.0.2:{port}", True)]
        wait_until(lambda: [(p.node_id, p.address, p.up) for p in c.status().peers] == want, what="n0 discovers n1")
        fut = c.save("dns", 1, 0, 1, {"a": b"dns" * 1000})
        assert fut.wait("peer", timeout=60) == ["n1"]


@pytest.mark.slow
def test_dead_owner_ranks_are_re_replicated_after_the_grace_period(daemon_factory):
    # replicas=1: n0's rank lives on n0 and n1. Once n0 has been down for OWNER_GRACE, the first
    # live holder (n1) copies it to the next live node (n2), so that losing n1 as well loses nothing.
    OWNER_GRACE = 4.0
    cl = Cluster(daemon_factory, 4, extra=("--knobs", f"owner_grace={OWNER_GRACE}"))
    job = "lost"
    arrs = {"w": shard(11, 3_000_000), "b": shard(12, 10)}
    with cl.d["n0"].client() as c:
        assert c.save(job, 5, 0, 1, arrs, metadata={"k": 1}).wait("peer", timeout=30) == ["n1"]
    cl.d["n0"].kill()
    t0 = time.monotonic()
    wait_until(lambda: cl.holders("n3", job, 5) == {0: ("n1", "n2")}, timeout=OWNER_GRACE + 60,
               what="n1 copies the dead owner's rank to n2")
    assert time.monotonic() - t0 > OWNER_GRACE / 2  # not before the grace period
    cl.d["n1"].kill()
    with cl.d["n3"].client() as c:
        ck = c.restore(job, 0)
        # n2 may already have pushed its copy to n3 (R + 1 live copies again): local or peer.
        assert (ck.step, ck.metadata) == (5, {"k": 1}) and ck.tier in ("peer", "local")
        assert all(np.array_equal(ck.shards[n], a) for n, a in arrs.items())
    wait_until(lambda: cl.holders("n2", job, 5) == {0: ("n2", "n3")}, timeout=60, what="two live copies again")
    # The owner comes back (a replacement) and restores its rank: placement is R again (n2), so
    # n3's extra copy is surplus and dropped, and nothing pushes it back (no ping-pong).
    cl.replace("n0")
    with cl.d["n0"].client() as c:
        ck = c.restore(job, 0)
        assert ck.tier == "peer" and all(np.array_equal(ck.shards[n], a) for n, a in arrs.items())
    wait_until(lambda: cl.holders("n2", job, 5) == {0: ("n0", "n2")}, timeout=60, what="surplus copy dropped")
    time.sleep(3)  # not a wait: a window in which a push-back would show (load can only hide one)
    assert cl.holders("n3", job, 5) == {0: ("n0", "n2")}
