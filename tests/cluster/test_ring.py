"""Pure ring rules: placement, who acts for a lost owner, copies wanted, neighbourhoods."""

from tierckptd.cluster import ring

NODES = [f"n{i:02d}" for i in range(10)]


def test_placement_skips_down_nodes_and_never_returns_the_owner():
    up = set(NODES) - {"n03"}
    assert ring.placement("n02", NODES, up, 2) == ["n04", "n05"]
    assert ring.placement("n09", NODES, up, 2) == ["n00", "n01"]  # wraps around
    assert ring.placement("n02", NODES, {"n02"}, 3) == []
    assert ring.placement("n02", NODES, up, 0) == []


def test_first_after_picks_the_next_holder_on_the_ring():
    assert ring.first_after("n05", ["n01", "n07", "n06"]) == "n06"
    assert ring.first_after("n05", ["n01", "n03"]) == "n01"  # wraps around
    assert ring.first_after("n05", ["n05", "n01"]) == "n01"  # the owner itself comes last
    assert ring.first_after("n05", []) is None


def test_copies_wanted_adds_a_stand_in_while_the_owner_lacks_the_rank():
    assert ring.copies_wanted(1, owner_holds=True) == 1
    assert ring.copies_wanted(1, owner_holds=False) == 2


def test_neighbourhood_size_does_not_grow_with_the_cluster():
    for n in (8, 64, 1024):
        nodes = [f"n{i:05d}" for i in range(n)]
        hood = ring.neighbourhood(nodes[5], nodes, replicas=1)
        assert hood == sorted({nodes[3], nodes[4], nodes[6], nodes[7]})
    small = ["a", "b", "c"]
    assert ring.neighbourhood("a", small, 1) == ["b", "c"]


def test_in_placement_is_the_first_r_plus_one_not_known_down():
    nodes = ["n0", "n1", "n2", "n3", "n4"]
    up = set(nodes)
    # R = 1: n1 and n2 (one spare) may hold n0's replicas, n3 may not.
    assert [ring.in_placement(n, "n0", nodes, up, 1) for n in ("n1", "n2", "n3")] == [True, True, False]
    # n1 known down: the walk widens by one, so n3 may.
    assert ring.in_placement("n3", "n0", nodes, up - {"n1"}, 1)
    assert not ring.in_placement("n4", "n0", nodes, up - {"n1"}, 1)
    assert not ring.in_placement("n0", "n0", nodes, up, 1)  # never the owner


def test_watched_walks_both_ways_and_widens_past_down_nodes():
    nodes = [f"n{i}" for i in range(10)]
    up = set(nodes)
    assert ring.watched("n5", nodes, up, 1, 3) == {"n6", "n7", "n4", "n3"}
    assert ring.watched("n5", nodes, up - {"n6"}, 1, 3) == {"n6", "n7", "n8", "n4", "n3"}
    # At most max_widen down nodes widen a side: with n6..n9 down and max_widen 1, the walk stops.
    assert ring.watched("n5", nodes, up - {"n6", "n7", "n8", "n9"}, 1, 1) == {"n6", "n7", "n4", "n3"}
    # The size of the answer does not grow with the cluster.
    big = [f"m{i:03d}" for i in range(500)]
    assert len(ring.watched("m250", big, set(big), 1, 3)) == 4
