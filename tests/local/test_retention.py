"""The retention and capacity rules (pure functions, no files)."""

from __future__ import annotations

from tierckptd.local.rules import (
    MIN_CHARGE,
    capacity_order,
    charge_file,
    charge_rank,
    plan_room,
    retention_floor,
    retention_victims,
)


def test_retention_floor_is_the_oldest_step_in_the_window():
    assert retention_floor([], 2) == -1
    assert retention_floor([5], 2) == -1
    assert retention_floor([1, 5, 9], 2) == 5
    assert retention_floor([1, 5, 9], 1) == 9


def test_retention_victims_are_older_than_the_floor_complete_or_not_unless_pinned():
    steps = [1, 2, 3, 5, 9, 12]  # 12 in progress
    assert retention_victims(steps, [1, 3, 5, 9], 2) == [1, 2, 3]
    assert retention_victims(steps, [1, 3, 5, 9], 2, pinned={2}) == [1, 3]
    assert retention_victims(steps, [9], 2) == []


def test_capacity_order_oldest_first_never_newest_complete_or_newer():
    jobs = {"a": {1: 30.0, 2: 10.0, 3: 50.0}, "b": {7: 20.0, 8: 5.0}, "c": {4: 1.0}}
    newest = {"a": 3, "b": 8, "c": None}  # c has no complete step: loses nothing
    assert capacity_order(jobs, newest, set(), allow_pinned=False) == [("a", 2), ("b", 7), ("a", 1)]
    assert capacity_order(jobs, newest, {("a", 2)}, allow_pinned=False) == [("b", 7), ("a", 1)]
    assert capacity_order(jobs, newest, {("a", 2)}, allow_pinned=True) == [("a", 2), ("b", 7), ("a", 1)]


def test_plan_room_decides_before_evicting():
    cands = [(("a", 1), 300), (("a", 2), 300)]
    assert plan_room(100, 1000, 500, 0, cands).fits and plan_room(100, 1000, 500, 0, cands).evict == ()
    p = plan_room(400, 1000, 900, 100, cands)  # over by 300: the pool (100) then one step
    assert p.fits and p.evict == (("a", 1),)
    assert not plan_room(800, 1000, 900, 0, cands).fits  # even both steps free only 600
    assert not plan_room(1001, 1000, 0, 0, cands).fits


def test_every_file_and_manifest_is_charged_a_minimum():
    assert charge_file(0) == MIN_CHARGE and charge_file(10 * MIN_CHARGE) == 10 * MIN_CHARGE
    assert charge_rank([0, 0, 0]) == 4 * MIN_CHARGE
