"""Discrete-event goodput simulator: the planner's closed form, checked event by event.

One synchronous job (all ranks stall together) trains ``work_s`` seconds of useful compute.
Checkpoints are nested, as in :mod:`tierckpt.goodput`: tier ``k`` saves every ``intervals_s[k]``
seconds of useful work, a save that reaches a tier also lands in the cheaper ones, and the trainer
stalls ``save_blocking_s`` of the most durable tier due. Failures arrive as a Poisson process of
the job's rate (:class:`~tierckpt.goodput.FailureModel`), each of a class drawn from its shares;
they also strike during saves and restores. What the closed form leaves out, the simulator has:

- **Lag.** A checkpoint is only on a tier ``lag_s[tier]`` seconds after its save ends (the peer
  copy and the drain run in the background; an async ``dcp.async_save`` upload is the same): a
  failure inside that window falls back to an older checkpoint.
- **What a failure destroys.** A node loss destroys the job's local tier (the lost node's shard
  is gone, so no local step is complete); a cluster loss destroys local and peer. A restore from
  tier ``k`` puts the step back into the cheaper tiers (the daemon writes it locally and
  re-replicates it).
- **Nodes.** With ``nodes`` > 1 and ``replicas`` R, a node loss within ``rereplicate_s`` of an
  earlier one hits one of the R nodes holding the first node's replicas with probability
  ``R / (nodes - 1)``; the peer tier is then incomplete and the job falls back to persistent.
- **Failures during restore.** The restore starts again (and may need a more durable tier).
- **One upload in flight** (``serial``): a save into such a tier first waits for the previous
  one to land there (``dcp.async_save`` done right); the wait is a save stall. Such uploads are
  the trainer's own, so any failure also loses the one in flight.

Goodput is ``work_s`` over wall time; badput splits into save stalls, restores (each includes
the process restart the caller folds into ``restore_s``) and lost compute (work redone and saves
cut short), as fractions of wall time, summed over ``runs`` independent runs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .errors import InvalidArgumentError
from .goodput import _SURVIVES, FAILURE_CLASSES, TIERS, Badput, FailureModel, TierCost, _cost_map, _number

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured over all its runs.

    Attributes:
        goodput: Useful work over wall time.
        badput: Fractions of wall time by cause.
        wall_s: Total simulated wall seconds.
        failures: Failures per class (including those during restores).
        restored_from: Restores per tier (``"scratch"``: nothing survived).
        runs: Independent runs simulated.
    """

    goodput: float
    badput: Badput
    wall_s: float
    failures: dict[str, int] = field(default_factory=dict)
    restored_from: dict[str, int] = field(default_factory=dict)
    runs: int = 1


class _Run:
    """One job from step 0 to ``work_s`` of useful compute."""

    def __init__(self, cost: Mapping[str, TierCost], failures: FailureModel, schedule: Mapping[str, int],
                 base_s: float, lag: Mapping[str, float], nodes: int, replicas: int, rereplicate_s: float,
                 rng: random.Random, serial: frozenset[str] = frozenset()) -> None:
        self.cost, self.failures, self.schedule, self.base = cost, failures, schedule, base_s
        self.serial = serial
        self.landing: dict[str, float] = {}
        self.lag, self.nodes, self.replicas, self.rereplicate = lag, nodes, replicas, rereplicate_s
        self.rng = rng
        self.t = 0.0
        self.next_fail = self._draw()
        self.held: dict[str, list[tuple[int, float]]] = {t: [] for t in schedule}  # (index, on tier from)
        self.last_node_loss = -math.inf
        self.save_s = self.restore_s = self.lost_s = 0.0
        self.counts = dict.fromkeys(FAILURE_CLASSES, 0)
        self.restored: dict[str, int] = {}

    def _draw(self) -> float:
        return self.t + self.rng.expovariate(1 / self.failures.mtbi_s)

    def _kind(self) -> str:
        u, acc = self.rng.random(), 0.0
        for c in FAILURE_CLASSES:
            acc += self.failures.fraction(c)
            if u < acc:
                return c
        return FAILURE_CLASSES[-1]

    def _due(self, index: int) -> str | None:
        due = [t for t, m in self.schedule.items() if index % m == 0]
        return max(due, key=TIERS.index) if due else None

    def _record(self, index: int, top: str) -> None:
        """A save of ``index`` reaching ``top`` (and every cheaper used tier) has just ended."""
        for t in self.schedule:
            if TIERS.index(t) <= TIERS.index(top):
                ready = self.t + self.lag.get(t, 0.0)
                self.landing[t] = ready
                kept = [(i, r) for i, r in self.held[t] if r > self.t]  # still in flight: keep
                best_ready = max((e for e in self.held[t] if e[1] <= self.t), default=None)
                self.held[t] = ([best_ready] if best_ready else []) + kept + [(index, ready)]

    def _wait(self, top: str) -> float:
        """Seconds a save reaching ``top`` waits for earlier uploads into ``serial`` tiers to land."""
        return max((self.landing.get(t, 0.0) - self.t for t in self.serial if t in self.schedule
                    and TIERS.index(t) <= TIERS.index(top)), default=0.0) if self.landing else 0.0

    def _source(self, kind: str) -> tuple[int, str | None]:
        """Newest checkpoint (index, tier) a failure of ``kind`` at ``self.t`` can restore from."""
        best: tuple[int, str | None] = (0, None)
        for t, entries in self.held.items():
            if kind not in _SURVIVES[t]:
                continue
            for i, ready in entries:
                if ready <= self.t and i > best[0]:
                    best = (i, t)
        return best

    def _destroy(self, kind: str) -> None:
        for t in self.serial:  # the trainer's own uploads die with it
            if t in self.held:
                self.held[t] = [e for e in self.held[t] if e[1] <= self.t]
        self.landing.clear()
        if kind == "node":
            lost = ["local"]
            # An earlier node loss not yet re-replicated: this one may hold its replicas.
            if self.nodes > 1 and self.t - self.last_node_loss < self.rereplicate \
                    and self.rng.random() < min(1.0, self.replicas / (self.nodes - 1)):
                lost.append("peer")
            self.last_node_loss = self.t
        elif kind == "cluster":
            lost = ["local", "peer"]
        else:
            lost = []
        for t in lost:
            if t in self.held:
                self.held[t] = []

    def fail(self, progress_index: float) -> int:
        """Handles the failure due now (and any during the restore); returns the restored index."""
        while True:
            kind = self._kind()
            self.counts[kind] += 1
            self._destroy(kind)
            index, tier = self._source(kind)
            restore = self.cost[tier].restore_s if tier else min(c.restore_s for c in self.cost.values())
            self.lost_s += max(0.0, progress_index - index) * self.base
            progress_index = index
            self.next_fail = self._draw()
            if self.t + restore <= self.next_fail:
                self.t += restore
                self.restore_s += restore
                self.restored[tier or "scratch"] = self.restored.get(tier or "scratch", 0) + 1
                for t in self.held:  # saves of the abandoned timeline are overwritten, never used
                    self.held[t] = [e for e in self.held[t] if e[0] <= index]
                    if tier and TIERS.index(t) < TIERS.index(tier):  # written back into the cheaper tiers
                        self.held[t] = [(index, self.t)]
                return index
            self.restore_s += self.next_fail - self.t  # cut short: pay it, then handle the next failure
            self.t = self.next_fail

    def run(self, work_s: float) -> None:
        index, last = 0, max(1, math.ceil(work_s / self.base - 1e-9))
        while index < last:
            seg = min(self.base, work_s - index * self.base)
            if self.t + seg > self.next_fail:  # fails mid-segment: the partial segment is lost
                self.lost_s += self.next_fail - self.t
                self.t = self.next_fail
                index = self.fail(index)
                continue
            self.t += seg
            index += 1
            top = self._due(index) if index < last else None
            if top is None:
                continue
            stall = self.cost[top].save_blocking_s + max(0.0, self._wait(top))
            if self.t + stall > self.next_fail:  # fails mid-save: the stall is lost work
                self.lost_s += self.next_fail - self.t
                self.t = self.next_fail
                index = self.fail(index)
                continue
            self.t += stall
            self.save_s += stall
            self._record(index, top)


def _schedule(cost: Mapping[str, TierCost], intervals_s: Mapping[str, float | None]) -> tuple[dict[str, int], float]:
    """Intervals as multiples of the shortest one; checks nesting and that each is a multiple."""
    used = {t: _number(iv, f"intervals_s[{t}]") for t in TIERS if (iv := intervals_s.get(t)) is not None}
    for t in intervals_s:
        if t not in cost:
            raise InvalidArgumentError(f"intervals_s: tier {t!r} has no TierCost")
    if not used:
        raise InvalidArgumentError("intervals_s: no tier has an interval")
    base = min(used.values())
    out = {}
    for t, iv in used.items():
        m = round(iv / base)
        if abs(m * base - iv) > 1e-6 * iv:
            raise InvalidArgumentError(f"intervals_s[{t}]: {iv:g} s is not a whole multiple of {base:g} s (nested)")
        out[t] = m
    return out, base


def simulate(costs: Iterable[TierCost], failures: FailureModel, intervals_s: Mapping[str, float | None], *,
             work_s: float, runs: int = 100, lag_s: Mapping[str, float] | None = None, nodes: int = 1,
             replicas: int = 1, rereplicate_s: float = 0.0, serial: Iterable[str] = (), seed: int = 0) -> SimResult:
    """Simulates training under failures, event by event.

    Args:
        costs: One :class:`~tierckpt.goodput.TierCost` per tier used; ``restore_s`` includes the
            restart.
        failures: The job's failure model (MTBI of the whole job, shares per class).
        intervals_s: Seconds of useful work between saves per tier (None or absent = unused);
            each a whole multiple of the shortest.
        work_s: Useful compute per run, seconds.
        runs: Independent runs (different failure draws) summed.
        lag_s: Seconds after a save ends until it is on each tier (default 0).
        nodes: Nodes in the job (only node-loss coincidences use it).
        replicas: Peer copies per shard.
        rereplicate_s: Seconds after a node loss until its replicas are restored elsewhere.
        serial: Tiers that take one upload at a time: a save into one first waits for the
            previous save to land there (its lag), stalling the trainer.
        seed: Random seed (same inputs and seed, same result).

    Returns:
        A :class:`SimResult`.

    Raises:
        InvalidArgumentError: An argument is invalid, or a failure class with a non-zero share
            has no used tier that survives it.
    """
    cost = _cost_map(costs)
    if not isinstance(failures, FailureModel):
        raise InvalidArgumentError(f"failures: expected FailureModel, got {type(failures).__name__}")
    schedule, base = _schedule(cost, intervals_s)
    for c in FAILURE_CLASSES:
        if failures.fraction(c) > 0 and not any(c in _SURVIVES[t] for t in schedule):
            raise InvalidArgumentError(f"intervals_s: no used tier survives {c} failures")
    work = _number(work_s, "work_s")
    lag = {t: _number(v, f"lag_s[{t}]", positive=False) for t, v in (lag_s or {}).items()}
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise InvalidArgumentError(f"runs: must be an integer >= 1, got {runs!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise InvalidArgumentError(f"nodes: must be an integer >= 1, got {nodes!r}")
    waits = frozenset(serial)
    if not waits <= set(TIERS):
        raise InvalidArgumentError(f"serial: unknown tiers {sorted(waits - set(TIERS))}")
    rng = random.Random(seed)
    wall = save = restore = lost = 0.0
    counts = dict.fromkeys(FAILURE_CLASSES, 0)
    restored: dict[str, int] = {}
    for _ in range(runs):
        r = _Run(cost, failures, schedule, base, lag, nodes, replicas, _number(rereplicate_s, "rereplicate_s",
                                                                                positive=False), rng, waits)
        r.run(work)
        wall, save, restore, lost = wall + r.t, save + r.save_s, restore + r.restore_s, lost + r.lost_s
        for k, v in r.counts.items():
            counts[k] += v
        for k, v in r.restored.items():
            restored[k] = restored.get(k, 0) + v
    return SimResult(runs * work / wall, Badput(save / wall, restore / wall, lost / wall), wall, counts, restored, runs)
