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
