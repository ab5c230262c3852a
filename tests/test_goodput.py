"""Tests of the goodput planner (tierckpt.goodput): formulas, optimality, policy, metrics.

The `tierckpt plan` command is tested in tests/test_cli.py."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
from tierckpt import goodput as gp
from tierckpt.errors import InvalidArgumentError
from tierckpt.goodput import FailureModel, Policy, TierCost

HOUR = 3600.0
COSTS = (TierCost("local", 0.5, 5.0), TierCost("peer", 2.0, 30.0), TierCost("persistent", 30.0, 300.0))
FAILURES = FailureModel(4 * HOUR, crash_fraction=0.3, node_fraction=0.6, cluster_fraction=0.1)

SAMPLE_METRICS = """\
# HELP tierckpt_commit_latency_seconds Local commit RPC time.
# TYPE tierckpt_commit_latency_seconds histogram
tierckpt_commit_latency_seconds_bucket{le="0.5"} 3.0
tierckpt_commit_latency_seconds_bucket{le="+Inf"} 4.0
tierckpt_commit_latency_seconds_count 4.0
tierckpt_commit_latency_seconds_sum 1.2
# HELP tierckpt_restore_latency_seconds Rank restore time by the tier it was served from.
# TYPE tierckpt_restore_latency_seconds histogram
tierckpt_restore_latency_seconds_bucket{le="+Inf",tier="local"} 2.0
tierckpt_restore_latency_seconds_count{tier="local"} 2.0
tierckpt_restore_latency_seconds_sum{tier="local"} 3.0
tierckpt_restore_latency_seconds_bucket{le="+Inf",tier="peer"} 1.0
tierckpt_restore_latency_seconds_count{tier="peer"} 1.0
tierckpt_restore_latency_seconds_sum{tier="peer"} 40.0
tierckpt_restore_latency_seconds_bucket{le="+Inf",tier="persistent"} 0.0
tierckpt_restore_latency_seconds_count{tier="persistent"} 0.0
tierckpt_restore_latency_seconds_sum{tier="persistent"} 0.0
# HELP tierckpt_saves_total Rank commits.
# TYPE tierckpt_saves_total counter
tierckpt_saves_total{result="ok",tier="local"} 4.0
"""


def badput(intervals: dict[str, float | None], costs=COSTS, failures=FAILURES) -> float:
    return gp.evaluate(costs, failures, intervals, 1.0).badput.total


# --- formulas -----------------------------------------------------------------------------------

def test_young_matches_hand_computed_values() -> None:
    assert gp.young_interval(1, 2) == pytest.approx(2.0)  # sqrt(2*1*2)
    assert gp.young_interval(10, 3600) == pytest.approx(268.3281573)  # sqrt(72000)


def test_daly_matches_hand_computed_values() -> None:
    # delta=1, M=2: r = 1/4, sqrt(4) * (1 + 1/6 + 1/36) - 1 = 2 * 43/36 - 1 = 25/18
    assert gp.daly_interval(1, 2) == pytest.approx(25 / 18)
    # delta=2, M=4: r = 1/4, 4 * 43/36 - 2 = 25/9
    assert gp.daly_interval(2, 4) == pytest.approx(25 / 9)
    # delta=10, M=3600: 268.3281573 * (1 + 0.0124226 + 0.0001543) - 10
    assert gp.daly_interval(10, 3600) == pytest.approx(261.7029, abs=1e-3)
    # delta >= 2M: the interval is M.
    assert gp.daly_interval(4, 2) == 2.0
    assert gp.daly_interval(9, 2) == 2.0


@pytest.mark.parametrize("fn", [gp.young_interval, gp.daly_interval])
@pytest.mark.parametrize("delta,mtbi,field", [(0, 1, "delta_s"), (-1, 1, "delta_s"), (1, math.nan, "mtbi_s"),
                                              (1, math.inf, "mtbi_s"), (True, 1, "delta_s")])
def test_interval_formulas_reject_bad_input(fn, delta, mtbi, field) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        fn(delta, mtbi)


def test_single_tier_model_is_exact_and_first_order_consistent() -> None:
    costs = (TierCost("persistent", 10.0, 60.0),)
    f = FailureModel(10 * HOUR, 0, 0, 1)
    p = gp.evaluate(costs, f, {"persistent": 600.0}, 1.0)
    assert p.goodput + p.badput.total == pytest.approx(1.0)
    b, m = p.badput, f.mtbi_s
    # First order: delta/tau, (tau + delta) / 2M, R/M (small delta/M, so within a few percent).
    assert b.save_overhead == pytest.approx(10 / 600, rel=0.05)
    assert b.lost_compute == pytest.approx(610 / (2 * m), rel=0.05)
    assert b.restore == pytest.approx(60 / m, rel=0.05)


def test_daly_is_close_to_the_exact_optimum_of_the_model() -> None:
    costs = (TierCost("persistent", 60.0, 120.0),)
    f = FailureModel(2 * HOUR, 0, 0, 1)
    grid = [10.0 * i for i in range(20, 300)]
    best = min(grid, key=lambda t: badput({"persistent": t}, costs, f))
    daly = gp.daly_interval(60, f.mtbi_s)
    assert abs(daly - best) <= 10.0
    assert badput({"persistent": daly}, costs, f) <= badput({"persistent": gp.young_interval(60, f.mtbi_s)}, costs, f)


# --- plan ---------------------------------------------------------------------------------------

def test_plan_uses_every_tier_and_recovery_classes() -> None:
    p = gp.plan(COSTS, FAILURES, 2.0)
    assert [t.name for t in p.tiers] == ["local", "peer", "persistent"]
    assert p.tier("local").recovers == ("crash",)
    assert p.tier("peer").recovers == ("node",)
    assert p.tier("persistent").recovers == ("cluster",)
    assert p.tier("local").mtbi_s == pytest.approx(4 * HOUR / 0.3)
    assert p.tier("persistent").mtbi_s == pytest.approx(40 * HOUR)
    # Each interval is Daly's for the tier's increment and the MTBI of the failures it recovers.
    assert p.intervals_s["local"] == pytest.approx(gp.daly_interval(0.5, 4 * HOUR / 0.3))
    assert p.intervals_s["peer"] == pytest.approx(gp.daly_interval(1.5, 4 * HOUR / 0.6))
    assert p.intervals_s["persistent"] == pytest.approx(gp.daly_interval(28.0, 40 * HOUR))
    assert p.baseline_interval_s == pytest.approx(gp.daly_interval(30.0, 4 * HOUR))
    local, peer, persistent = (p.tier(t).interval_s or 0.0 for t in gp.TIERS)
    assert 0 < local < peer < persistent
    with pytest.raises(KeyError):
        p.tier("nowhere")


def test_plan_optimum_minimises_badput_against_neighbours() -> None:
    p = gp.plan(COSTS, FAILURES, 1.0)
    best = badput(p.intervals_s)
    assert best == pytest.approx(p.badput.total)
    for tier in ("local", "peer", "persistent"):
        for factor in (0.9, 0.97, 1.03, 1.1):
            moved = dict(p.intervals_s)
            moved[tier] = p.intervals_s[tier] * factor  # type: ignore[operator]
            assert badput(moved) > best, (tier, factor)
    # Dropping a tier is worse too.
    assert badput({**p.intervals_s, "local": None}) > best
    assert badput({**p.intervals_s, "peer": None}) > best
    # And the baseline is the optimum of the persistent-only schedule.
    base = p.baseline_badput.total
    for factor in (0.9, 1.1):
        assert badput({"persistent": p.baseline_interval_s * factor}) > base


def test_multi_tier_beats_baseline_when_local_is_cheap() -> None:
    p = gp.plan(COSTS, FAILURES, 1.0)
    assert p.goodput > p.baseline_goodput + 0.02
    assert p.badput.restore < p.baseline_badput.restore
    assert p.badput.lost_compute < p.baseline_badput.lost_compute
    assert p.goodput == pytest.approx(1 - p.badput.total)


def test_cluster_only_failures_plan_equals_baseline() -> None:
    p = gp.plan(COSTS, FailureModel(4 * HOUR, 0, 0, 1), 2.0)
    assert p.intervals_s == {"local": None, "peer": None, "persistent": pytest.approx(p.baseline_interval_s)}
    assert p.goodput == pytest.approx(p.baseline_goodput)
    assert p.badput == p.baseline_badput
    assert p.intervals_steps["persistent"] == p.baseline_interval_steps
    assert Policy(p).intervals == {"persistent": p.baseline_interval_steps}


def test_crash_only_failures_use_local_only() -> None:
    p = gp.plan(COSTS, FailureModel(4 * HOUR, 1, 0, 0), 2.0)
    assert p.intervals_s["local"] == pytest.approx(gp.daly_interval(0.5, 4 * HOUR))
    assert p.intervals_s["peer"] is None and p.intervals_s["persistent"] is None
    assert p.goodput > p.baseline_goodput


def test_without_local_tier_crashes_recover_from_peers() -> None:
    p = gp.plan(COSTS[1:], FAILURES, 2.0)
    assert [t.name for t in p.tiers] == ["peer", "persistent"]
    assert p.tier("peer").recovers == ("crash", "node")
    assert p.intervals_s["peer"] == pytest.approx(gp.daly_interval(2.0, 4 * HOUR / 0.9))


def test_nearly_free_peer_saves_are_pooled_with_local() -> None:
    # Peer costs 0.1 s over local: its own optimum would be shorter than local's, so both share
    # the optimum of their summed increment (0.6 s) and rate (crash + node).
    costs = (TierCost("local", 0.5, 5.0), TierCost("peer", 0.6, 30.0), TierCost("persistent", 30.0, 300.0))
    p = gp.plan(costs, FAILURES, 1.0)
    assert p.intervals_s["local"] == p.intervals_s["peer"] == pytest.approx(gp.daly_interval(0.6, 4 * HOUR / 0.9))
    # Pooling beats the alternatives: no local tier, or local raised to the peer optimum.
    no_local = {"peer": gp.daly_interval(0.6, 4 * HOUR / 0.9), "persistent": p.intervals_s["persistent"]}
    assert p.badput.total < badput(no_local, costs)
    raised = {**p.intervals_s, "local": gp.daly_interval(0.5, 4 * HOUR / 0.3)}
    raised["peer"] = raised["local"]
    assert p.badput.total < badput(raised, costs)
    pol = Policy(p)
    assert pol.intervals["local"] == pol.intervals["peer"]


def test_young_method() -> None:
    p = gp.plan(COSTS, FAILURES, 1.0, method="young")
    assert p.method == "young"
    assert p.intervals_s["local"] == pytest.approx(gp.young_interval(0.5, 4 * HOUR / 0.3))
    with pytest.raises(InvalidArgumentError, match="method"):
        gp.plan(COSTS, FAILURES, 1.0, method="guess")


def test_evaluate_given_plan() -> None:
    p = gp.evaluate(COSTS, FAILURES, {"local": 60.0, "peer": 300.0, "persistent": 3600.0}, 2.0)
    assert p.intervals_s == {"local": 60.0, "peer": 300.0, "persistent": 3600.0}
    assert p.intervals_steps == {"local": 30, "peer": 150, "persistent": 1800}
    assert p.goodput < gp.plan(COSTS, FAILURES, 2.0).goodput
    # A tier left out of the mapping is not used; a tier that recovers nothing only costs.
    q = gp.evaluate(COSTS, FailureModel(4 * HOUR, 0, 0, 1), {"local": 60.0, "persistent": 3600.0}, 2.0)
    assert q.tier("local").recovers == () and q.tier("local").mtbi_s is None
    assert q.badput.save_overhead > gp.evaluate(COSTS, FailureModel(4 * HOUR, 0, 0, 1), {"persistent": 3600.0},
                                                2.0).badput.save_overhead


@pytest.mark.parametrize("intervals,match", [
    ({"local": 60.0}, r"intervals_s: no used tier survives node"),
    ({"local": 60.0, "peer": 30.0, "persistent": 600.0}, r"intervals_s\[peer\]"),
    ({"persistent": -1.0}, r"intervals_s\[persistent\]"),
    ({"elsewhere": 1.0}, r"intervals_s: tier 'elsewhere'"),
])
def test_evaluate_rejects_bad_intervals(intervals, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        gp.evaluate(COSTS, FAILURES, intervals, 1.0)


def test_plan_to_dict_is_json() -> None:
    doc = json.loads(json.dumps(gp.plan(COSTS, FAILURES, 2.0).to_dict()))
    assert [t["name"] for t in doc["tiers"]] == ["local", "peer", "persistent"]
    assert doc["baseline"]["tier"] == "persistent"
    assert doc["badput"]["total"] == pytest.approx(1 - doc["goodput"])


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make,field", [
    (lambda: TierCost("local", 0, 1), "local.save_blocking_s"),
    (lambda: TierCost("peer", -1, 1), "peer.save_blocking_s"),
    (lambda: TierCost("peer", math.nan, 1), "peer.save_blocking_s"),
    (lambda: TierCost("persistent", 1, -1), "persistent.restore_s"),
    (lambda: TierCost("persistent", 1, math.inf), "persistent.restore_s"),
    (lambda: TierCost("tape", 1, 1), "name"),
    (lambda: TierCost("local", "1", 1), "local.save_blocking_s"),  # type: ignore[arg-type]
    (lambda: FailureModel(0, 0.5, 0.5, 0), "mtbi_s"),
    (lambda: FailureModel(math.nan, 0.5, 0.5, 0), "mtbi_s"),
    (lambda: FailureModel(10, -0.1, 1.1, 0), "crash_fraction"),
    (lambda: FailureModel(10, 0.1, math.nan, 0.9), "node_fraction"),
    (lambda: FailureModel(10, 0, 0, 1.5), "cluster_fraction"),
    (lambda: FailureModel(10, 0.5, 0.5, 0.2), "fractions"),
    (lambda: gp.plan(COSTS[:2], FAILURES, 1.0), "costs"),
    (lambda: gp.plan(COSTS + COSTS[:1], FAILURES, 1.0), "costs"),
    (lambda: gp.plan(COSTS, FAILURES, 0), "step_time_s"),
    (lambda: gp.plan(COSTS, None, 1.0), "failures"),  # type: ignore[arg-type]
    (lambda: Policy(gp.plan(COSTS, FAILURES, 1.0), step_time_s=-2), "step_time_s"),
])
def test_validation_names_the_field(make, field) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        make()
    assert str(e.value).startswith(field)


def test_dataclasses_are_frozen_and_normalised() -> None:
    c = TierCost("local", 1, 0)
    assert isinstance(c.save_blocking_s, float) and c.restore_s == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.restore_s = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        FAILURES.mtbi_s = 1.0  # type: ignore[misc]
    assert FailureModel(10, 0.1, 0.2, 0.7).fraction("cluster") == 0.7


# --- policy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("step_time", [0.3, 1.0, 2.0, 7.5, 40.0, 1000.0])
def test_policy_saves_line_up(step_time: float) -> None:
    p = gp.plan(COSTS, FAILURES, step_time)
    pol = Policy(p)
    iv = pol.intervals
    assert iv == p.intervals_steps
    assert set(iv) == {"local", "peer", "persistent"}
    assert all(v >= 1 for v in iv.values())
    assert iv["peer"] % iv["local"] == 0 and iv["persistent"] % iv["peer"] == 0
    assert pol.should_save(0) is None
    for step in range(1, 3 * iv["persistent"] + 1):
        due = pol.should_save(step)
        if step % iv["persistent"] == 0:
            assert due == "persistent"
        elif step % iv["peer"] == 0:
            assert due == "peer"
        elif step % iv["local"] == 0:
            assert due == "local"
        else:
            assert due is None


def test_policy_rounds_to_steps_and_accepts_new_step_time() -> None:
    p = gp.evaluate(COSTS, FAILURES, {"local": 100.0, "peer": 430.0, "persistent": 2900.0}, 10.0)
    assert Policy(p).intervals == {"local": 10, "peer": 40, "persistent": 280}  # 43 -> 4x10, 290 -> 7x40
    half = gp.evaluate(COSTS, FAILURES, {"local": 15.0, "peer": 45.0, "persistent": 150.0}, 10.0)
    assert Policy(half).intervals == {"local": 2, "peer": 4, "persistent": 16}  # halves round up
    assert Policy(p, step_time_s=1000.0).intervals == {"local": 1, "peer": 1, "persistent": 3}
    partial = gp.evaluate(COSTS, FAILURES, {"peer": 100.0, "persistent": 1000.0}, 1.0)
    pol = Policy(partial)
    assert pol.intervals == {"peer": 100, "persistent": 1000}
    assert [pol.should_save(s) for s in (50, 100, 1000, 1001)] == [None, "peer", "persistent", None]
    assert "peer" in repr(pol)


@pytest.mark.parametrize("step", [-1, 1.5, "3", True])
def test_policy_rejects_bad_steps(step) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^step"):
        Policy(gp.plan(COSTS, FAILURES, 1.0)).should_save(step)


# --- metrics ------------------------------------------------------------------------------------

EXPECTED_MEASURED = {"local_save": 0.3, "local_restore": 1.5, "peer_restore": 40.0}


def test_metrics_inputs_from_exposition_text() -> None:
    assert gp.metrics_inputs(SAMPLE_METRICS) == pytest.approx(EXPECTED_MEASURED)
    assert gp.metrics_inputs("") == {}
    assert gp.metrics_inputs("# only a comment\nsome_other_metric 1\n") == {}


def test_metrics_inputs_without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client.parser", None)  # import now raises ImportError
    assert gp.metrics_inputs(SAMPLE_METRICS) == pytest.approx(EXPECTED_MEASURED)
    text = 'tierckpt_restore_latency_seconds_sum{job="a,b",tier="persistent"} 90 1700000000\n' \
           'tierckpt_restore_latency_seconds_count{tier="persistent",job="a,b"} 3\n'
    assert gp.metrics_inputs(text) == pytest.approx({"persistent_restore": 30.0})


def test_metrics_inputs_from_daemon_registry() -> None:
    from prometheus_client import generate_latest
    from tierckptd import metrics

    m = metrics.Metrics()
    m.commit_latency.observe(0.2)
    m.commit_latency.observe(0.4)
    m.restore_latency.labels(tier="persistent").observe(120.0)
    got = gp.metrics_inputs(generate_latest(m.registry).decode())
    assert got == pytest.approx({"local_save": 0.3, "persistent_restore": 120.0})
