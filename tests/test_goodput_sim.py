"""Tests of the discrete-event goodput simulator (tierckpt.goodput.simulate) against the planner's
closed form, and of its effects the closed form leaves out (lag, node coincidences)."""

from __future__ import annotations

import pytest
from tierckpt import goodput as gp
from tierckpt.errors import InvalidArgumentError
from tierckpt.goodput import FailureModel, TierCost, evaluate, simulate

HOUR = 3600.0
COSTS = (TierCost("local", 1.0, 30.0), TierCost("peer", 1.0, 40.0), TierCost("persistent", 20.0, 120.0))
FAILURES = FailureModel(HOUR, crash_fraction=0.6, node_fraction=0.3, cluster_fraction=0.1)


def _nested(plan: gp.Plan) -> dict[str, float | None]:
    """The plan's intervals rounded to whole seconds, each a multiple of the shortest."""
    base = round(min(v for v in plan.intervals_s.values() if v))
    return {t: (base * max(1, round(v / base)) if v else None) for t, v in plan.intervals_s.items()}


def test_persistent_only_matches_the_closed_form() -> None:
    iv = {"persistent": gp.daly_interval(20.0, HOUR)}
    want = evaluate(COSTS, FAILURES, iv, 1.0)
    got = simulate(COSTS, FAILURES, iv, work_s=200 * HOUR, runs=10, seed=3)
    assert got.goodput == pytest.approx(want.goodput, abs=0.01)
    assert got.badput.save_overhead == pytest.approx(want.badput.save_overhead, abs=0.005)
    assert got.badput.restore == pytest.approx(want.badput.restore, abs=0.005)
    assert got.badput.lost_compute == pytest.approx(want.badput.lost_compute, abs=0.008)
    assert set(got.restored_from) <= {"persistent", "scratch"}
    assert got.goodput + got.badput.total == pytest.approx(1.0)


def test_planned_multi_tier_matches_the_closed_form_and_beats_the_baseline() -> None:
    p = gp.plan(COSTS, FAILURES, 1.0)
    iv = _nested(p)
    want = evaluate(COSTS, FAILURES, iv, 1.0).goodput
    got = simulate(COSTS, FAILURES, iv, work_s=200 * HOUR, runs=10, seed=4)
    base = simulate(COSTS, FAILURES, {"persistent": p.baseline_interval_s}, work_s=200 * HOUR, runs=10, seed=4)
    assert got.goodput == pytest.approx(want, abs=0.015)
    assert base.goodput == pytest.approx(p.baseline_goodput, abs=0.015)
    assert got.goodput - base.goodput == pytest.approx(want - p.baseline_goodput, abs=0.02)
    # Each class restores from the cheapest tier that survives it.
    assert got.restored_from["local"] == pytest.approx(got.failures["crash"], rel=0.1)
    assert got.restored_from["peer"] == pytest.approx(got.failures["node"], rel=0.15)


def test_without_failures_only_saves_cost() -> None:
    calm = FailureModel(1e12, 0.6, 0.3, 0.1)
    got = simulate(COSTS, calm, {"local": 100.0, "persistent": 1000.0}, work_s=10_000.0, runs=1)
    # 99 saves: every 10th reaches persistent (20 s), the others only local (1 s); none at the end.
    assert got.wall_s == pytest.approx(10_000 + 9 * 20 + 90 * 1)
    assert got.badput.restore == 0 and got.badput.lost_compute == 0


def test_same_seed_same_result_and_runs_differ() -> None:
    a = simulate(COSTS, FAILURES, {"persistent": 600.0}, work_s=10 * HOUR, runs=3, seed=7)
    assert a == simulate(COSTS, FAILURES, {"persistent": 600.0}, work_s=10 * HOUR, runs=3, seed=7)
    assert a != simulate(COSTS, FAILURES, {"persistent": 600.0}, work_s=10 * HOUR, runs=3, seed=8)


def test_lag_costs_goodput() -> None:
    """An upload that takes as long as the interval leaves failures an older checkpoint."""
    iv = {"persistent": 600.0}
    quick = simulate(COSTS, FAILURES, iv, work_s=100 * HOUR, runs=5, seed=1)
    slow = simulate(COSTS, FAILURES, iv, work_s=100 * HOUR, runs=5, seed=1, lag_s={"persistent": 500.0})
    assert slow.badput.lost_compute > quick.badput.lost_compute + 0.05
    assert slow.goodput < quick.goodput - 0.05


def test_node_losses_close_together_fall_back_to_persistent() -> None:
    nodes_only = FailureModel(600.0, 0.0, 1.0, 0.0)
    iv = {"peer": 60.0, "persistent": 600.0}
    kw = {"work_s": 50 * HOUR, "runs": 2, "seed": 2, "replicas": 1}
    apart = simulate(COSTS, nodes_only, iv, nodes=2, rereplicate_s=0.0, **kw)
    close = simulate(COSTS, nodes_only, iv, nodes=2, rereplicate_s=HOUR, **kw)
    many = simulate(COSTS, nodes_only, iv, nodes=1000, rereplicate_s=HOUR, **kw)
    assert "persistent" not in apart.restored_from
    assert close.restored_from["persistent"] > 0.5 * close.failures["node"]
    assert many.restored_from.get("persistent", 0) < 0.01 * many.failures["node"]
    assert close.goodput < apart.goodput


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"intervals_s": {}}, "intervals_s"),
    ({"intervals_s": {"local": 10.0}}, "intervals_s"),  # nothing survives node or cluster losses
    ({"intervals_s": {"local": 10.0, "persistent": 25.0}}, "intervals_s\\[persistent\\]"),  # not a multiple
    ({"work_s": 0}, "work_s"),
    ({"runs": 0}, "runs"),
    ({"nodes": 0}, "nodes"),
    ({"lag_s": {"peer": -1}}, "lag_s\\[peer\\]"),
])
def test_rejects_bad_input(kwargs: dict, field: str) -> None:
    args = {"intervals_s": {"persistent": 600.0}, "work_s": HOUR, **kwargs}
    with pytest.raises(InvalidArgumentError, match=field):
        simulate(COSTS, FAILURES, **args)


def test_serial_uploads_stall_and_die_with_the_trainer() -> None:
    calm = FailureModel(1e12, 0.6, 0.3, 0.1)
    iv = {"persistent": 100.0}
    # Upload 150 s from the end of a save; the next save starts 100 s of work later: it waits 50 s.
    got = simulate(COSTS, calm, iv, work_s=1000.0, runs=1, lag_s={"persistent": 150.0}, serial=["persistent"])
    assert got.wall_s == pytest.approx(1000 + 9 * 20 + 8 * 50)
    free = simulate(COSTS, calm, iv, work_s=1000.0, runs=1, lag_s={"persistent": 150.0})
    assert free.wall_s == pytest.approx(1000 + 9 * 20)
    # A crash restores from local; the trainer's own upload in flight is lost with it, a daemon's
    # drain lands anyway and serves a later cluster loss.
    kw = {"work_s": 100 * HOUR, "runs": 3, "seed": 5, "lag_s": {"persistent": 300.0}}
    ivs = {"local": 100.0, "persistent": 600.0}
    own = simulate(COSTS, FAILURES, ivs, serial=["persistent"], **kw)
    daemon = simulate(COSTS, FAILURES, ivs, **kw)
    assert own.badput.lost_compute > daemon.badput.lost_compute
    with pytest.raises(InvalidArgumentError, match="serial"):
        simulate(COSTS, FAILURES, iv, work_s=HOUR, serial=["disk"])
