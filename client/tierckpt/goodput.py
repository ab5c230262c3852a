"""Goodput planner: how often to checkpoint into each tier.

Badput model
------------
Checkpoint badput per mean time between interruptions (MTBI) is
``(T_load + T_save_overhead + T_lost_compute) / MTBI``; here it is extended to the three tiers.
Failures are independent Poisson processes of three classes, given as shares of all failures:

=========  ===================================  =============================
class      example                              survived by
=========  ===================================  =============================
crash      trainer process dies, node is fine   local, peer, persistent
node       one node lost (up to R = replicas)   peer, persistent
cluster    every node lost                      persistent
=========  ===================================  =============================

Each tier has a restore time ``R_k`` and a blocking save cost: seconds the trainer stalls for one
save that reaches the tier, the cheaper tiers it passes through included. Saves are nested (a
persistent step is also a peer and a local step), so a step pays the cost of the most durable
tier due. Equivalently, tier ``k`` adds ``delta_k`` = its cost minus that of the next cheaper
used tier (floored at 0) every ``tau_k`` seconds: save overhead ``sum_k delta_k / tau_k``.

Multi-level rule (Moody et al., "Design, modeling, and evaluation of a scalable multi-level
checkpointing system", SC10): a failure recovers from the newest checkpoint that survives it.
With nested saves that is the cheapest used tier surviving it, so each failure class has exactly
one *recovery tier*, and tier ``k`` only pays off for the failures it recovers: a local
checkpoint does nothing for a node loss, which rolls back to the last peer checkpoint whatever
the local interval. Tier ``k`` is therefore driven by ``lambda_k = sum(share_c for c recovered
by k) / MTBI``, and its interval uses ``M_k = 1 / lambda_k`` and ``delta_k``. When a cheaper
tier is not used, its classes move up to the next used one (without a local tier, crashes
recover from peers, so the peer tier sees crash + node). This is deliberately *not* the rate of
all failures that need tier ``k`` or above: counting node or cluster losses for the local tier
would buy local saves that no such failure can use (with ``cluster_fraction == 1`` the best
plan is exactly the persistent-only baseline).

Per tier, with ``L = tau + delta`` and ``N = exp(lambda * L) - 1`` (expected failures before a
segment commits), the expected wall time per committed segment is ``E = N * (R + 1/lambda)``,
which splits exactly into fractions of wall time: useful ``tau / E``, save overhead
``delta / E``, restore ``N * R / E``, and lost compute ``(N / lambda - L) / E`` (about
``lambda * L / 2``: half an interval per failure). This is Daly's exponential model without
failures during restore; to first order it is ``delta/tau + lambda * (tau/2 + R)``. Plan badput
is the sum over tiers, goodput ``1 - badput`` (floored at 0). Summing treats the levels as
independent, ignoring second-order coupling (a node loss also discards progress the local level
was about to checkpoint); the Markov model of Moody et al. is not attempted.

Optimal intervals
-----------------
- Young (J.W. Young, "A first order approximation to the optimum checkpoint interval", CACM
  17(9), 1974): ``tau = sqrt(2 * delta * M)``, the exact optimum of the first-order model.
- Daly (J.T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", FGCS 22(3), 2006): ``tau = sqrt(2*delta*M) * (1 + sqrt(delta/(2M))/3 + delta/(18M))
  - delta`` for ``delta < 2M``, else ``tau = M``; a near-optimum of the exponential model.

:func:`plan` tries each subset of the optional tiers (persistent is always in), applies the
chosen formula (Daly by default) to every tier that recovers some failure, and keeps the subset
with the least modelled badput. Nesting needs ``local <= peer <= persistent``; a tier whose own
optimum is shorter than the one below is pooled with it (one interval, the optimum for their
summed increments and rates; pool-adjacent-violators). The baseline is persistent only, at its
optimum for the MTBI of all failures. A tier that recovers no failure gets no interval: the
planner schedules no saves that no modelled failure needs (use ``persist_every`` for durable
copies wanted for other reasons). :class:`Policy` rounds intervals to whole steps (>= 1), each a
multiple of the tier below.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .errors import InvalidArgumentError

__all__ = [
    "TIERS",
    "FAILURE_CLASSES",
    "TierCost",
    "FailureModel",
    "Badput",
    "TierPlan",
    "Plan",
    "Policy",
    "young_interval",
    "daly_interval",
    "plan",
    "evaluate",
    "metrics_inputs",
    "simulate",
    "SimResult",
]

TIERS = ("local", "peer", "persistent")
"""Tiers from cheapest to most durable."""
FAILURE_CLASSES = ("crash", "node", "cluster")
"""Failure classes from mildest to worst."""
_SURVIVES = {"local": ("crash",), "peer": ("crash", "node"), "persistent": FAILURE_CLASSES}
_FRACTION_TOL = 1e-6
_METHODS = ("daly", "young")


def _number(value: object, field: str, *, positive: bool = True) -> float:
    """Returns ``value`` as a finite float that is > 0 (or >= 0); else raises naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{field}: must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise InvalidArgumentError(f"{field}: must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return v


@dataclass(frozen=True)
class TierCost:
    """Measured or estimated cost of one tier.

    Attributes:
        name: ``"local"``, ``"peer"`` or ``"persistent"``.
        save_blocking_s: Seconds the trainer stalls for one save that reaches this tier, cheaper
            tiers included (> 0). For a tier the daemon fills in the background, give the stall
            the trainer actually sees, back-pressure from a drain that cannot keep up included.
        restore_s: Seconds to restore from this tier after a failure (>= 0).
    """

    name: str
    save_blocking_s: float
    restore_s: float

    def __post_init__(self) -> None:
        if self.name not in TIERS:
            raise InvalidArgumentError(f"name: must be one of {', '.join(TIERS)}, got {self.name!r}")
        object.__setattr__(self, "save_blocking_s", _number(self.save_blocking_s, f"{self.name}.save_blocking_s"))
        object.__setattr__(self, "restore_s", _number(self.restore_s, f"{self.name}.restore_s", positive=False))


@dataclass(frozen=True)
class FailureModel:
    """How often the job is interrupted, and by what.

    Attributes:
        mtbi_s: Mean time between interruptions of any class, in seconds (> 0).
        crash_fraction: Share of failures that are process crashes (node survives).
        node_fraction: Share that lose single nodes (within the peer replica count).
        cluster_fraction: Share that lose every node. The three shares sum to 1.
    """

    mtbi_s: float
    crash_fraction: float
    node_fraction: float
    cluster_fraction: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "mtbi_s", _number(self.mtbi_s, "mtbi_s"))
        for c in FAILURE_CLASSES:
            f = _number(getattr(self, f"{c}_fraction"), f"{c}_fraction", positive=False)
            if f > 1:
                raise InvalidArgumentError(f"{c}_fraction: must be <= 1, got {f!r}")
            object.__setattr__(self, f"{c}_fraction", f)
        total = self.crash_fraction + self.node_fraction + self.cluster_fraction
        if abs(total - 1) > _FRACTION_TOL:
            raise InvalidArgumentError(
                f"fractions: crash_fraction + node_fraction + cluster_fraction must sum to 1, got {total:.6g}")

    def fraction(self, failure_class: str) -> float:
        """Returns the share of failures of ``failure_class`` (one of :data:`FAILURE_CLASSES`)."""
        return float(getattr(self, f"{failure_class}_fraction"))


@dataclass(frozen=True)
class Badput:
    """Fractions of wall time lost, by cause (see the module docstring for the model).

    Attributes:
        save_overhead: Trainer stalled in committed saves.
        restore: Restoring after failures (``T_load``).
        lost_compute: Work (and interrupted saves) redone after failures.
    """

    save_overhead: float = 0.0
    restore: float = 0.0
    lost_compute: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the three components."""
        return self.save_overhead + self.restore + self.lost_compute

    def __add__(self, other: Badput) -> Badput:
        return Badput(self.save_overhead + other.save_overhead, self.restore + other.restore,
                      self.lost_compute + other.lost_compute)


@dataclass(frozen=True)
class TierPlan:
    """One tier of a :class:`Plan`.

    Attributes:
        name: Tier name.
        interval_s: Seconds of training between checkpoints into this tier; None = not used.
        interval_steps: The interval as whole steps, aligned to the tier below; None = not used.
        recovers: Failure classes (with a non-zero share) that recover from this tier.
        mtbi_s: Mean time between those failures; None when it recovers none.
    """

    name: str
    interval_s: float | None
    interval_steps: int | None
    recovers: tuple[str, ...]
    mtbi_s: float | None


@dataclass(frozen=True)
class Plan:
    """A checkpoint schedule with its expected goodput and the persistent-only baseline.

    Attributes:
        tiers: One :class:`TierPlan` per tier whose cost was given, cheapest first.
        step_time_s: Seconds per training step used to convert intervals into steps.
        goodput: Expected fraction of wall time doing useful, never-redone training.
        badput: Breakdown of ``1 - goodput`` (before flooring at 0).
        baseline_interval_s: Interval of the persistent-only baseline, in seconds.
        baseline_interval_steps: The same in whole steps.
        baseline_goodput: Expected goodput of the baseline.
        baseline_badput: Breakdown of the baseline's badput.
        method: ``"daly"`` or ``"young"``: the formula used for optimal intervals.
    """

    tiers: tuple[TierPlan, ...]
    step_time_s: float
    goodput: float
    badput: Badput
    baseline_interval_s: float
    baseline_interval_steps: int
    baseline_goodput: float
    baseline_badput: Badput
    method: str = "daly"

    def __post_init__(self) -> None:
        _number(self.step_time_s, "step_time_s")
        if self.method not in _METHODS:
            raise InvalidArgumentError(f"method: must be one of {', '.join(_METHODS)}, got {self.method!r}")

    def tier(self, name: str) -> TierPlan:
        """Returns the :class:`TierPlan` called ``name``.

        Raises:
            KeyError: The plan has no such tier (its cost was not given).
        """
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def intervals_s(self) -> dict[str, float | None]:
        """Seconds between checkpoints per tier (None = tier not used)."""
        return {t.name: t.interval_s for t in self.tiers}

    @property
    def intervals_steps(self) -> dict[str, int | None]:
        """Steps between checkpoints per tier (None = tier not used)."""
        return {t.name: t.interval_steps for t in self.tiers}

    def to_dict(self) -> dict[str, object]:
        """Returns a JSON-serialisable view of the plan."""
        def bp(b: Badput) -> dict[str, float]:
            return {"save_overhead": b.save_overhead, "restore": b.restore, "lost_compute": b.lost_compute,
                    "total": b.total}
        return {
            "method": self.method, "step_time_s": self.step_time_s,
            "tiers": [{"name": t.name, "interval_s": t.interval_s, "interval_steps": t.interval_steps,
                       "recovers": list(t.recovers), "mtbi_s": t.mtbi_s} for t in self.tiers],
            "goodput": self.goodput, "badput": bp(self.badput),
            "baseline": {"tier": "persistent", "interval_s": self.baseline_interval_s,
                         "interval_steps": self.baseline_interval_steps, "goodput": self.baseline_goodput,
                         "badput": bp(self.baseline_badput)},
        }


def young_interval(delta_s: float, mtbi_s: float) -> float:
    """Young's first-order optimum checkpoint interval ``sqrt(2 * delta * M)``.

    Args:
        delta_s: Checkpoint cost in seconds (> 0).
        mtbi_s: Mean time between the failures this checkpoint recovers from (> 0).

    Returns:
        Seconds of work between checkpoints.

    Raises:
        InvalidArgumentError: An argument is not a finite positive number.
    """
    return math.sqrt(2 * _number(delta_s, "delta_s") * _number(mtbi_s, "mtbi_s"))


def daly_interval(delta_s: float, mtbi_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval.

    ``sqrt(2*delta*M) * (1 + sqrt(delta/(2M))/3 + delta/(18M)) - delta`` for ``delta < 2M``,
    else ``M``.

    Args:
        delta_s: Checkpoint cost in seconds (> 0).
        mtbi_s: Mean time between the failures this checkpoint recovers from (> 0).

    Returns:
        Seconds of work between checkpoints.

    Raises:
        InvalidArgumentError: An argument is not a finite positive number.
    """
    d, m = _number(delta_s, "delta_s"), _number(mtbi_s, "mtbi_s")
    if d >= 2 * m:
        return m
    r = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(r) / 3 + r / 9) - d


def _tier_badput(interval: float, delta: float, restore: float, rate: float) -> Badput:
    """Wall-time fractions of one tier under the per-tier exponential model."""
    length = interval + delta
    if rate == 0:
        return Badput(save_overhead=delta / length)
    x = rate * length
    if x > 700:  # exp overflows; limits as N -> infinity.
        return Badput(restore=rate * restore / (1 + rate * restore), lost_compute=1 / (1 + rate * restore))
    n = math.expm1(x)
    wall = n * (restore + 1 / rate)
    return Badput(delta / wall, n * restore / wall, (n / rate - length) / wall)


def _cost_map(costs: Iterable[TierCost]) -> dict[str, TierCost]:
    out: dict[str, TierCost] = {}
    for c in costs:
        if not isinstance(c, TierCost):
            raise InvalidArgumentError(f"costs: expected TierCost items, got {type(c).__name__}")
        if c.name in out:
            raise InvalidArgumentError(f"costs: tier {c.name!r} given twice")
        out[c.name] = c
    if "persistent" not in out:
        raise InvalidArgumentError("costs: a persistent TierCost is required (it is the baseline and the last resort)")
    return out


def _recovery(intervals: Mapping[str, float], failures: FailureModel) -> dict[str, tuple[str, ...]]:
    """Maps each used tier to the failure classes (share > 0) whose newest surviving checkpoint it holds."""
    rec: dict[str, list[str]] = {t: [] for t in TIERS if t in intervals}
    for c in FAILURE_CLASSES:
        if failures.fraction(c) == 0:
            continue
        cands = [t for t in rec if c in _SURVIVES[t]]
        if not cands:
            raise InvalidArgumentError(
                f"intervals_s: no used tier survives {c} failures (share {failures.fraction(c):g}); give "
                f"{'persistent' if c == 'cluster' else 'peer or persistent'} an interval")
        rec[min(cands, key=lambda t: (intervals[t], TIERS.index(t)))].append(c)
    return {t: tuple(cs) for t, cs in rec.items()}


def _rate(classes: Iterable[str], failures: FailureModel) -> float:
    return sum(failures.fraction(c) for c in classes) / failures.mtbi_s


def _badput(cost: Mapping[str, TierCost], failures: FailureModel,
            intervals: Mapping[str, float | None]) -> tuple[Badput, dict[str, tuple[str, ...]]]:
    used: dict[str, float] = {t: iv for t in TIERS if (iv := intervals.get(t)) is not None}
    rec = _recovery(used, failures)
    extra = _increments(cost, used)
    total = Badput()
    for t, classes in rec.items():
        total = total + _tier_badput(used[t], extra[t], cost[t].restore_s, _rate(classes, failures))
    return total, rec


def _increments(cost: Mapping[str, TierCost], used: Iterable[str]) -> dict[str, float]:
    """Extra stall of a save reaching each used tier over one reaching the used tier below (>= 0)."""
    out: dict[str, float] = {}
    below = 0.0
    for t in TIERS:
        if t in used:
            out[t] = max(0.0, cost[t].save_blocking_s - below)
            below = cost[t].save_blocking_s
    return out


def _align_steps(intervals_s: Mapping[str, float | None], step_time_s: float) -> dict[str, int | None]:
    """Rounds intervals to whole steps (>= 1), each a multiple of the used tier below it."""
    out: dict[str, int | None] = {}
    below: int | None = None
    for t in TIERS:
        if t not in intervals_s:
            continue
        iv = intervals_s[t]
        if iv is None:
            out[t] = None
            continue
        raw = iv / step_time_s  # Rounded half up (not to even), to a whole multiple of the tier below.
        unit = below or 1
        out[t] = below = unit * max(1, math.floor(raw / unit + 0.5))
    return out


def _optimum(method: str) -> Callable[[float, float], float]:
    if method not in _METHODS:
        raise InvalidArgumentError(f"method: must be one of {', '.join(_METHODS)}, got {method!r}")
    return daly_interval if method == "daly" else young_interval


def _make_plan(cost: Mapping[str, TierCost], failures: FailureModel, step_time_s: float,
               intervals: Mapping[str, float | None], method: str) -> Plan:
    badput, rec = _badput(cost, failures, intervals)
    base_iv = _optimum(method)(cost["persistent"].save_blocking_s, failures.mtbi_s)
    base_badput, _ = _badput(cost, failures, {"persistent": base_iv})
    steps = _align_steps({t: intervals.get(t) for t in cost}, step_time_s)
    tiers = []
    for t in TIERS:
        if t in cost:
            classes = rec.get(t, ())
            rate = _rate(classes, failures)
            tiers.append(TierPlan(t, intervals.get(t), steps[t], classes, 1 / rate if rate > 0 else None))
    base_steps = max(1, math.floor(base_iv / step_time_s + 0.5))
    return Plan(tuple(tiers), step_time_s, max(0.0, 1 - badput.total), badput, base_iv, base_steps,
                max(0.0, 1 - base_badput.total), base_badput, method)


def plan(costs: Iterable[TierCost], failures: FailureModel, step_time_s: float, *, method: str = "daly") -> Plan:
    """Chooses which tiers to use and how often to save into each.

    Args:
        costs: One :class:`TierCost` per available tier; persistent is required, local and peer
            are optional (a missing tier is never used).
        failures: The failure model.
        step_time_s: Seconds per training step (> 0), to express intervals in steps.
        method: ``"daly"`` (default) or ``"young"``: the optimum-interval formula.

    Returns:
        The plan with the least modelled badput, with the persistent-only baseline.

    Raises:
        InvalidArgumentError: An argument is invalid; the message names it.
    """
    cost = _cost_map(costs)
    if not isinstance(failures, FailureModel):
        raise InvalidArgumentError(f"failures: expected FailureModel, got {type(failures).__name__}")
    step = _number(step_time_s, "step_time_s")
    opt = _optimum(method)
    candidates: list[dict[str, float | None]] = []
    optional = [t for t in ("local", "peer") if t in cost]
    for n in range(len(optional) + 1):  # Simplest subsets first.
        for subset in itertools.combinations(optional, n):
            tiers = (*subset, "persistent")
            # Recovery tier of each class: the cheapest tier of the subset that survives it.
            classes: dict[str, list[str]] = {t: [] for t in tiers}
            for c in FAILURE_CLASSES:
                if failures.fraction(c) > 0:
                    classes[next(t for t in tiers if c in _SURVIVES[t])].append(c)
            used = [t for t in tiers if classes[t]]
            extra = _increments(cost, used)
            # Nesting needs local <= peer <= persistent. Pool adjacent violators: a tier whose own
            # optimum is shorter than the one below shares one interval with it, the optimum for
            # their summed increments and summed failure rates.
            groups: list[tuple[list[str], float, float, float]] = []  # (tiers, delta, share, tau)
            for t in used:
                g = ([t], extra[t], sum(failures.fraction(c) for c in classes[t]))
                while True:
                    tau = opt(g[1], failures.mtbi_s / g[2]) if g[1] > 0 else 0.0
                    if not groups or tau >= groups[-1][3]:
                        break
                    top = groups.pop()
                    g = (top[0] + g[0], top[1] + g[1], top[2] + g[2])
                groups.append((*g, tau))
            intervals: dict[str, float | None] = {t: None for t in TIERS}
            for members, _, _, tau in groups:
                intervals.update(dict.fromkeys(members, tau))
            candidates.append(intervals)
    # min() keeps the first of equals: the simplest subset wins ties.
    best = min(candidates, key=lambda iv: round(_badput(cost, failures, iv)[0].total, 12))
    return _make_plan(cost, failures, step, best, method)


def evaluate(costs: Iterable[TierCost], failures: FailureModel, intervals_s: Mapping[str, float | None],
             step_time_s: float, *, method: str = "daly") -> Plan:
    """Evaluates a schedule chosen by the caller.

    Saves are taken as nested, so used intervals must not decrease from local to peer to
    persistent; each failure recovers from the cheapest used tier that survives it.

    Args:
        costs: One :class:`TierCost` per tier; persistent is required (for the baseline).
        failures: The failure model.
        intervals_s: Seconds between checkpoints per tier name; a missing or None entry = not used.
        step_time_s: Seconds per training step (> 0).
        method: Formula for the baseline's interval, ``"daly"`` or ``"young"``.

    Returns:
        A :class:`Plan` holding the given intervals, their goodput, and the baseline.

    Raises:
        InvalidArgumentError: An argument is invalid, an interval names a tier without a cost, or
            a failure class with a non-zero share has no used tier that survives it, or the
            intervals decrease towards more durable tiers.
    """
    cost = _cost_map(costs)
    if not isinstance(failures, FailureModel):
        raise InvalidArgumentError(f"failures: expected FailureModel, got {type(failures).__name__}")
    step = _number(step_time_s, "step_time_s")
    intervals: dict[str, float] = {}
    for t, iv in intervals_s.items():
        if t not in cost:
            raise InvalidArgumentError(f"intervals_s: tier {t!r} has no TierCost")
        if iv is not None:
            intervals[t] = _number(iv, f"intervals_s[{t}]")
    used = [t for t in TIERS if t in intervals]
    for lo, hi in itertools.pairwise(used):
        if intervals[hi] < intervals[lo]:
            raise InvalidArgumentError(f"intervals_s[{hi}]: {intervals[hi]:g} s is shorter than "
                                       f"intervals_s[{lo}] ({intervals[lo]:g} s); saves are nested")
    return _make_plan(cost, failures, step, intervals, method)


class Policy:
    """Decides, step by step, which tier a save should reach.

    Intervals are the plan's, rounded to whole steps (>= 1), persistent a multiple of peer and
    peer a multiple of local, so that every persistent save is also a peer and local save.
    """

    def __init__(self, plan: Plan, step_time_s: float | None = None) -> None:
        """Builds the step schedule.

        Args:
            plan: A :class:`Plan` from :func:`plan` or :func:`evaluate`.
            step_time_s: Seconds per step; defaults to the plan's (give it when the measured step
                time differs).

        Raises:
            InvalidArgumentError: ``step_time_s`` is not a finite positive number.
        """
        step = plan.step_time_s if step_time_s is None else _number(step_time_s, "step_time_s")
        self._intervals = {t: s for t, s in _align_steps(plan.intervals_s, step).items() if s is not None}

    @property
    def intervals(self) -> dict[str, int]:
        """Steps between saves per used tier (unused tiers are absent)."""
        return dict(self._intervals)

    def should_save(self, step: int) -> str | None:
        """Returns the most durable tier due at ``step``, or None.

        Args:
            step: Training step (>= 0); step 0, the untrained state, is never saved.

        Returns:
            ``"persistent"``, ``"peer"`` or ``"local"`` (a save into a tier also lands in the
            cheaper used tiers), or None when no tier is due.

        Raises:
            InvalidArgumentError: ``step`` is not a non-negative integer.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step: must be an integer >= 0, got {step!r}")
        if step == 0:
            return None
        for t in reversed(TIERS):
            if t in self._intervals and step % self._intervals[t] == 0:
                return t
        return None

    def __repr__(self) -> str:
        return f"Policy(intervals={self._intervals!r})"


# --- metrics ---------------------------------------------------------------------------------

_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _samples_fallback(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """Minimal exposition-format parser: ``name{labels} value`` lines, comments skipped."""
    for raw in text.splitlines():
        line = raw.strip()
        m = _SAMPLE_RE.match(line) if line and not line.startswith("#") else None
        if m is None:
            continue
        labels = {k: re.sub(r"\\(.)", lambda e: "\n" if e.group(1) == "n" else e.group(1), v)
                  for k, v in _LABEL_RE.findall(m.group(2) or "")}
        try:
            yield m.group(1), labels, float(m.group(3))
        except ValueError:
            continue


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:  # The client does not depend on prometheus_client (a daemon extra).
        yield from _samples_fallback(text)
        return
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, dict(s.labels), float(s.value)


def metrics_inputs(text: str) -> dict[str, float]:
    """Derives measured tier costs from a daemon's Prometheus ``/metrics`` text.

    Uses means (``_sum / _count``) of the histograms ``tierckpt_commit_latency_seconds`` (local
    commit, taken as the local blocking save cost) and ``tierckpt_restore_latency_seconds``
    (label ``tier``). Histograms absent or with zero count are left out. The commit latency
    is a lower bound of the save stall (the copy into the staging file comes before the commit
    RPC); give ``--local-save`` when the trainer has measured the stall itself.

    Args:
        text: Prometheus text exposition format.

    Returns:
        A subset of ``{"local_save", "local_restore", "peer_restore", "persistent_restore"}``
        mapped to seconds.

    Raises:
        ValueError: ``text`` is not valid exposition format (prometheus_client parser only).
    """
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for name, labels, value in _samples(text):
        base, _, kind = name.rpartition("_")
        if kind not in ("sum", "count") or not math.isfinite(value):
            continue
        if base == "tierckpt_commit_latency_seconds":
            key = "local_save"
        elif base == "tierckpt_restore_latency_seconds" and labels.get("tier") in TIERS:
            key = f"{labels['tier']}_restore"
        else:
            continue
        acc = sums if kind == "sum" else counts
        acc[key] = acc.get(key, 0.0) + value
    return {k: sums.get(k, 0.0) / counts[k] for k in sorted(counts) if counts[k] > 0}


from .goodput_sim import SimResult, simulate  # noqa: E402  (the simulator builds on the definitions above)
