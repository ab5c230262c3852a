"""Membership without daemons: who is watched, completeness with a partial view, the peer guard."""

import pytest
from tierckpt.errors import PermissionDeniedError
from tierckptd.cluster.membership import Held, Membership
from tierckptd.config import load_config
from tierckptd.local.manifest import Manifest
from tierckptd.peer.guard import PeerGuard


def _membership(n: int, me: int = 0, replicas: int = 1) -> Membership:
    peers = ",".join(f"n{i:03d}=127.0.0.1:{10000 + i}" for i in range(n))
    cfg = load_config(overrides={"node_id": f"n{me:03d}", "peers": peers, "replicas": replicas, "socket": "",
                                 "listen": "127.0.0.1:0", "insecure_listen": True})
    return Membership(cfg)


def test_a_node_watches_r_plus_one_neighbours_each_side_whatever_the_cluster_size():
    for n in (6, 50, 500):
        m = _membership(n, me=10 % n)
        assert len(m.watched()) == min(4, n - 1)


def test_a_down_neighbour_widens_the_watch_by_one():
    m = _membership(50, me=10)
    assert m.watched() == {"n008", "n009", "n011", "n012"}
    m.mark_down(m.peers["n011"], RuntimeError("gone"))
    assert m.watched() == {"n008", "n009", "n011", "n012", "n013"}
    m.mark_up(m.peers["n012"])
    assert m.down_for("n012") == 0.0
    first = m.down_for("n011")
    assert 0.0 < first <= m.down_for("n011")  # counted from when it was first seen down


def test_completeness_with_a_partial_view_expects_the_ranks_owned_in_view():
    m = _membership(50, me=10)
    for n in ("n009", "n011"):
        m.mark_up(m.peers[n])
    # n009 owns rank 9 and holds it for steps 1 and 2; n011 owns rank 11 but saved only step 1.
    m.peers["n009"].held = {("j", s, 9): Held(50, "n009", f"g{s}", 1, 0.0) for s in (1, 2)}
    m.peers["n011"].held = {("j", 1, 11): Held(50, "n011", "g", 1, 0.0)}
    m.note_own("j", 10)
    m._rebuild_index()
    assert m.is_complete("j", 1, 50, {10})
    assert not m.is_complete("j", 2, 50, {10})  # n011's rank 11 is missing at step 2
    assert not m.is_complete("j", 3, 50, set())


def test_small_clusters_keep_the_exact_rule():
    m = _membership(4, me=0)
    for p in m.peers.values():
        m.mark_up(p)
    m.peers["n001"].held = {("j", 1, 1): Held(4, "n001", "g", 1, 0.0)}
    m._rebuild_index()
    assert not m.is_complete("j", 1, 4, {0})
    assert m.is_complete("j", 1, 2, {0})


def _manifest(owner: str) -> Manifest:
    return Manifest(job="j", step=1, rank=0, world_size=1, node=owner, generation="g", shards=(), metadata_json="{}",
                    created=0.0)


def test_guard_accepts_copies_only_from_owners_whose_placement_includes_this_node():
    m = _membership(50, me=10)
    guard = PeerGuard(m.config, m, replicas=1)
    guard.check_replica(_manifest("n009"))  # R + 1 = 2 nodes after n009: n010, n011
    guard.check_replica(_manifest("n008"))
    with pytest.raises(PermissionDeniedError, match="not in the placement"):
        guard.check_replica(_manifest("n007"))
    with pytest.raises(PermissionDeniedError, match="as its owner"):
        guard.check_replica(_manifest("n010"))
    with pytest.raises(PermissionDeniedError, match="not in the placement"):
        guard.check_replica(_manifest("stranger"))
    m.mark_down(m.peers["n009"], RuntimeError("down"))
    guard.check_replica(_manifest("n007"))  # n009 is down: n010 is now second after n007


def test_a_peer_that_came_back_outside_refresh_is_reported_once_by_the_next_refresh():
    """A replication's probe or an operator fan-out may see a peer return first; the maintenance
    loop must still learn of it (it catches up the ranks that peer should hold)."""
    import asyncio

    async def run() -> list[bool]:
        m = _membership(6, me=0)
        m.connect_all()  # nobody listens on those ports: each refresh finds them down
        m.mark_down(m.peers["n001"], RuntimeError("partitioned"))
        m.mark_up(m.peers["n001"])  # seen back by some other path
        try:
            return [(await m.refresh())[0], (await m.refresh())[0]]
        finally:
            await m.close()

    assert asyncio.run(run()) == [True, False]
