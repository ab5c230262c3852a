"""The bounded map shared by the content layout's upload threads."""

from tierckptd.persistent.ledger import Bounded

from ..threads import Checked, join_all


def test_bounded_forgets_the_oldest_and_survives_concurrent_writers():
    b = Bounded(100)

    def writer(base: int) -> None:  # an unlocked OrderedDict raises or corrupts here
        for i in range(5000):
            b[(base, i)] = i
            b.get((base, i - 1), 0)

    threads = [Checked(writer, t) for t in range(4)]
    for t in threads:
        t.start()
    join_all(threads)  # re-raises a writer's error
    assert len(b) == 100
    b2 = Bounded(2)
    b2["a"], b2["b"], b2["c"] = 1, 2, 3
    assert list(b2) == ["b", "c"] and b2.get("a") is None and b2.get("c") == 3
