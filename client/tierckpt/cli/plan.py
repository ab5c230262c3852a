"""``tierckpt plan``: the goodput planner (:mod:`tierckpt.goodput`) from what a user knows.

Inputs, each from (first that applies) its flag, a daemon's ``/metrics`` (``--metrics-url``), or a
default:

- ``--mtbi`` and ``--step-time``: required; ``--persistent-save``: required (the persistent tier
  is always planned); ``--local-save`` / ``--peer-save``: a tier whose save cost is not known is
  not planned (``--metrics-url`` measures the local one).
- Failure mix: :data:`DEFAULT_FRACTIONS` when no fraction is given; fractions not given share
  what the given ones leave in the ratio of the defaults (two given: the third is the rest).
- Restore time of a tier: measured (mean of ``tierckpt_restore_latency_seconds{tier=...}``) when
  ``--metrics-url`` has restores from that tier, else the tier's save time (the same bytes over
  the same medium, the other way).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, TextIO

from ..errors import InvalidArgumentError, UnavailableError
from ..goodput import FAILURE_CLASSES, TIERS, FailureModel, TierCost, metrics_inputs, plan
from ._commands import write_json

__all__ = ["DEFAULT_FRACTIONS", "add_plan_arguments", "run_plan"]

DEFAULT_FRACTIONS = {"crash": 0.3, "node": 0.6, "cluster": 0.1}
"""Failure mix when none is given: most interruptions of large jobs take one node (GPU, NIC or host
faults), a third are process crashes the node survives, a few lose the whole cluster (or more
nodes than there are replicas). Conservative on the cluster share, which only the persistent tier
survives."""

_COST_FLAGS = ("local-save", "local-restore", "peer-save", "peer-restore", "persistent-save", "persistent-restore")
_UNITS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|h)?\s*$")
_FRACTION_TOL = 1e-6


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``tierckpt plan`` flags to ``parser`` (values are parsed by :func:`run_plan`).

    Args:
        parser: The ``plan`` sub-command's parser.
    """
    parser.add_argument("--mtbi", metavar="DURATION", help="mean time between interruptions of the job, any cause: "
                        "seconds, or with suffix ms/s/m/h, e.g. 4h (required)")
    parser.add_argument("--step-time", metavar="DURATION", help="time per training step, e.g. 1 or 1500ms (required)")
    for c, what in (("crash", "process crashes the node survives"), ("node", "losses of single nodes"),
                    ("cluster", "losses of every node")):
        parser.add_argument(f"--{c}-fraction", metavar="FRACTION",
                            help=f"share of interruptions that are {what}, 0..1 (default "
                                 f"{DEFAULT_FRACTIONS[c]:g}; the three sum to 1: fractions not given share the rest)")
    for flag in _COST_FLAGS:
        tier, what = flag.split("-")
        if what == "save":
            extra = (" (required)" if tier == "persistent" else
                     "; not given and not measured: the tier is not planned")
            text = f"seconds the trainer stalls for one save reaching the {tier} tier, cheaper tiers included{extra}"
        else:
            text = f"seconds to restore from the {tier} tier (default: measured by --metrics-url, else --{tier}-save)"
        parser.add_argument(f"--{flag}", metavar="DURATION", help=text)
    parser.add_argument("--metrics-url", metavar="URL",
                        help="a daemon's metrics endpoint, http://HOST:PORT/metrics (or HOST:PORT): mean restore "
                             "times per tier and the local commit time fill the flags not given")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    parser.add_argument("--plot", metavar="FILE",
                        help="also draw goodput against each tier's interval (the others at the plan's) into "
                             "FILE, an image whose format its suffix names (.png, .svg, .pdf); needs matplotlib "
                             "(pip install 'tierckpt[plot]')")


def _duration(text: object, flag: str, *, positive: bool = True) -> float:
    m = _DURATION_RE.match(str(text))
    if m is None:
        raise InvalidArgumentError(f"{flag}: expected seconds or a duration like 90s, 15m, 4h, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(value) or (positive and value <= 0):
        raise InvalidArgumentError(f"{flag}: must be {'> 0' if positive else '>= 0'}, got {text!r}")
    return value


def _metrics_url(raw: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d+", raw):  # HOST:PORT shorthand
        return f"http://{raw}/metrics"
    if not raw.startswith(("http://", "https://")):
        raise InvalidArgumentError(f"--metrics-url: expected http://HOST:PORT/metrics, got {raw!r}")
    return raw


def _fetch(url: str, timeout: float) -> str:
    import urllib.error
    import urllib.request  # Here, not at import time: only `plan --metrics-url` needs HTTP.

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise UnavailableError(f"--metrics-url: cannot fetch {url}: {reason} (is the daemon started with "
                               "--metrics-port, and is --metrics-host reachable from here?)") from e


def _fractions(args: argparse.Namespace) -> tuple[dict[str, float], list[str]]:
    """Returns the failure mix and the classes whose share was not given."""
    given: dict[str, float] = {}
    for c in FAILURE_CLASSES:
        raw = getattr(args, f"{c}_fraction", None)
        if raw is None:
            continue
        try:
            f = float(raw)
        except ValueError:
            f = math.nan
        if not 0 <= f <= 1:
            raise InvalidArgumentError(f"--{c}-fraction: must be a number in [0, 1], got {raw!r}")
        given[c] = f
    missing = [c for c in FAILURE_CLASSES if c not in given]
    rest = 1 - sum(given.values())
    if rest < -_FRACTION_TOL:
        names = "/".join(f"--{c}-fraction" for c in given)
        raise InvalidArgumentError(f"{names}: sum to {1 - rest:.6g} > 1")
    if not missing:
        if abs(rest) > _FRACTION_TOL:
            raise InvalidArgumentError(
                f"--crash-fraction/--node-fraction/--cluster-fraction: must sum to 1, got {1 - rest:.6g}")
        return given, []
    if not given:
        return dict(DEFAULT_FRACTIONS), missing
    weight = sum(DEFAULT_FRACTIONS[c] for c in missing)
    for c in missing:
        given[c] = max(0.0, rest) * DEFAULT_FRACTIONS[c] / weight
    return given, missing


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    return f"{s / 60:.3g} min" if s < 7200 else f"{s / 3600:.3g} h"


def run_plan(args: argparse.Namespace, out: TextIO, *, timeout: float = 10.0) -> int:
    """Runs ``tierckpt plan``: prints the optimal schedule and its goodput against the baseline.

    Args:
        args: Namespace from a parser set up by :func:`add_plan_arguments`.
        out: Where to print.
        timeout: Seconds to wait for ``--metrics-url``.

    Returns:
        0 (errors are raised, before anything is printed).

    Raises:
        InvalidArgumentError: A flag is missing or invalid; the message names it.
        UnavailableError: ``--metrics-url`` could not be fetched.
    """
    if args.mtbi is None:
        raise InvalidArgumentError("--mtbi: required (mean time between interruptions, e.g. 4h)")
    mtbi = _duration(args.mtbi, "--mtbi")
    if args.step_time is None:
        raise InvalidArgumentError("--step-time: required (time per training step, e.g. 1 or 1500ms)")
    step = _duration(args.step_time, "--step-time")
    fractions, default_fractions = _fractions(args)
    url = _metrics_url(args.metrics_url) if getattr(args, "metrics_url", None) else None
    values, source = _cost_inputs(args, url, timeout)
    costs = _tier_costs(values, source)
    failures = FailureModel(mtbi, fractions["crash"], fractions["node"], fractions["cluster"])
    result = plan(costs, failures, step)
    if getattr(args, "plot", None):
        from ._plot import plot_curves

        plot_curves(args.plot, costs, failures, step, result)
    defaulted = [f"{c}_fraction" for c in default_fractions] + [k for k, s in source.items() if s == "default"]
    measured_keys = sorted(k for k, s in source.items() if s == "measured")
    if getattr(args, "json", False):
        write_json({"inputs": {"mtbi_s": mtbi, "step_time_s": step,
                               **{f"{c}_fraction": fractions[c] for c in FAILURE_CLASSES}, **values},
                    "measured": measured_keys, "defaulted": defaulted, "metrics_url": url,
                    **result.to_dict()}, out)
        return 0
    mix = ", ".join(f"{c} {fractions[c]:.0%}" for c in FAILURE_CLASSES)
    out.write(f"MTBI {_fmt_s(mtbi)} ({mix}{'; default mix' if len(default_fractions) == 3 else ''}), "
              f"step {_fmt_s(step)}, {result.method} intervals\n")
    if measured_keys:
        out.write(f"measured from {url}: {', '.join(measured_keys)}\n")
    _print_tables(out, result, costs, source)
    _print_notes(out, source, measured_keys, default_fractions)
    return 0


def _cost_inputs(args: argparse.Namespace, url: str | None, timeout: float) -> tuple[dict[str, float], dict[str, str]]:
    """Save/restore costs from the flags, then from ``--metrics-url``; with where each came from."""
    values: dict[str, float] = {}
    source: dict[str, str] = {}
    for flag in _COST_FLAGS:
        key = flag.replace("-", "_")
        raw = getattr(args, key, None)
        if raw is not None:
            values[key] = _duration(raw, f"--{flag}", positive=key.endswith("_save"))
            source[key] = "flag"
    if url is not None:
        try:
            measured = metrics_inputs(_fetch(url, timeout))
        except InvalidArgumentError:
            raise
        except ValueError as e:  # Not Prometheus text.
            raise InvalidArgumentError(f"--metrics-url: response of {url} is not Prometheus text: {e}") from e
        for key, v in measured.items():
            if key not in values and (key.endswith("_restore") or v > 0):
                values[key], source[key] = v, "measured"
    if "persistent_save" not in values:
        raise InvalidArgumentError("--persistent-save: required (the persistent tier is always planned)")
    return values, source


def _tier_costs(values: dict[str, float], source: dict[str, str]) -> list[TierCost]:
    """The planned tiers' costs (a tier without a save cost is not planned; a missing restore
    time defaults to the save time, marked "default" in ``source``)."""
    costs: list[TierCost] = []
    for tier in TIERS:
        save_key, restore_key = f"{tier}_save", f"{tier}_restore"
        if save_key not in values:
            if restore_key in source and source[restore_key] == "flag":
                raise InvalidArgumentError(f"--{tier}-save: required to plan the {tier} tier "
                                           f"(--{tier}-restore is given)")
            values.pop(restore_key, None)
            source.pop(restore_key, None)
            continue  # Tier not planned.
        if restore_key not in values:
            values[restore_key], source[restore_key] = values[save_key], "default"
        costs.append(TierCost(tier, values[save_key], values[restore_key]))
    return costs


def _print_tables(out: TextIO, result: Any, costs: list[TierCost], source: dict[str, str]) -> None:
    w = out.write
    w(f"\n{'tier':<11} {'save':>9} {'restore':>14}  {'recovers':<19} {'their MTBI':>10} {'interval':>10} "
      f"{'steps':>8}\n")
    mark = {"flag": "", "measured": " (m)", "default": " (*)"}
    for t in result.tiers:
        c = next(x for x in costs if x.name == t.name)
        restore = f"{_fmt_s(c.restore_s)}{mark[source[f'{t.name}_restore']]}"
        w(f"{t.name:<11} {_fmt_s(c.save_blocking_s):>9} {restore:>14}  "
          f"{','.join(t.recovers) or '-':<19} {_fmt_s(t.mtbi_s):>10} "
          f"{_fmt_s(t.interval_s) if t.interval_s is not None else 'not used':>10} "
          f"{t.interval_steps if t.interval_steps is not None else '-':>8}\n")
    w(f"\n{'':<11} {'goodput':>8} {'badput':>8} {'save':>8} {'restore':>8} {'lost':>8}\n")
    for label, g, b in (("plan", result.goodput, result.badput),
                        ("baseline", result.baseline_goodput, result.baseline_badput)):
        w(f"{label:<11} {g:>8.2%} {b.total:>8.2%} {b.save_overhead:>8.2%} {b.restore:>8.2%} "
          f"{b.lost_compute:>8.2%}\n")
    w(f"\nsteps: whole steps, each tier's a multiple of the one below, so saves line up\n"
      f"baseline: persistent only, every {_fmt_s(result.baseline_interval_s)} "
      f"({result.baseline_interval_steps} steps)\n")


def _print_notes(out: TextIO, source: dict[str, str], measured_keys: list[str], default_fractions: list[str]) -> None:
    notes = []
    if any(s == "default" for s in source.values()):
        notes.append("(*) restore time not given: taken as the tier's save time (give --TIER-restore, or "
                     "--metrics-url to measure it)")
    if measured_keys:
        notes.append("(m) measured: mean of the daemon's histogram")
    if default_fractions and len(default_fractions) < 3:
        notes.append(f"{', '.join(default_fractions)} share: the rest, split in the default ratio")
    for n in notes:
        out.write(n + "\n")
