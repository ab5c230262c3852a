"""Catalog deltas: a neighbour that knows version v gets only what changed since."""

from tierckptd.cluster import changelog
from tierckptd.cluster.changelog import ChangeLog


def test_deltas_carry_changes_and_removals_only():
    held = {("j", 1, 0): "g1", ("j", 1, 1): "g2"}
    log = ChangeLog(lambda: dict(held))
    v1, delta, entries, removed = log.since(0)
    assert (delta, sorted(entries), removed) == (False, ["g1", "g2"], [])
    assert log.since(v1) == (v1, True, [], [])  # nothing changed: an empty delta, same version
    held[("j", 2, 0)] = "g3"
    held[("j", 1, 0)] = "g1b"  # a re-save
    del held[("j", 1, 1)]
    v2, delta, entries, removed = log.since(v1)
    assert v2 > v1 and delta and sorted(entries) == ["g1b", "g3"] and removed == [("j", 1, 1)]
    assert log.since(v2) == (v2, True, [], [])


def test_a_version_from_the_future_or_past_the_horizon_gets_a_snapshot(monkeypatch):
    monkeypatch.setattr(changelog, "MAX_TOMBSTONES", 2)
    held = {("j", s, 0): f"g{s}" for s in range(5)}
    log = ChangeLog(lambda: dict(held))
    v1 = log.since(0)[0]
    assert log.since(v1 + 10)[1] is False  # another instance's version: full snapshot
    for s in range(4):
        del held[("j", s, 0)]
        log.since(0)
    _, delta, entries, removed = log.since(v1)
    assert not delta and entries == ["g4"] and removed == []  # tombstones forgotten: full snapshot
