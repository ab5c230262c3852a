"""``tierckpt plan --plot FILE``: goodput against each tier's interval, drawn with matplotlib.

Each planned tier gets one curve: its interval swept from a twentieth to twenty times the plan's
(log-spaced), the other tiers held at the plan's intervals, goodput from
:func:`tierckpt.goodput.evaluate`; a dot marks the plan's choice and a dashed line the baseline
(persistent only). Intervals that would break the nesting (a more durable tier saving more
often than a cheaper one) are left out of the curve.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import FailedPreconditionError, InvalidArgumentError
from ..goodput import FailureModel, TierCost, evaluate

__all__ = ["plot_curves", "curves"]

POINTS = 61
SPAN = 20.0


def curves(costs: list[TierCost], failures: FailureModel, step_s: float, result: Any) -> dict[str, list[tuple]]:
    """tier -> [(interval seconds, goodput)] (see the module docstring)."""
    chosen = {t.name: t.interval_s for t in result.tiers}
    out: dict[str, list[tuple]] = {}
    for name, best in chosen.items():
        if best is None:
            continue
        points = []
        for i in range(POINTS):
            x = best * SPAN ** (2 * i / (POINTS - 1) - 1)
            try:
                g = evaluate(costs, failures, {**chosen, name: x}, step_s, method=result.method).goodput
            except InvalidArgumentError:
                continue  # not nested
            points.append((x, g))
        out[name] = points
    return out


def plot_curves(path: str, costs: list[TierCost], failures: FailureModel, step_s: float, result: Any) -> None:
    """Draw :func:`curves` into ``path`` (its suffix names the format).

    Raises:
        InvalidArgumentError: ``path``'s directory does not exist or its suffix is not an image format.
        FailedPreconditionError: matplotlib is not installed.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InvalidArgumentError(f"--plot: {parent} is not a directory")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FailedPreconditionError("--plot needs matplotlib: pip install 'tierckpt[plot]'") from None
    fmt = os.path.splitext(path)[1].lstrip(".").lower()
    if fmt not in plt.figure().canvas.get_supported_filetypes():
        plt.close("all")
        raise InvalidArgumentError(f"--plot: {path}: not an image suffix (.png, .svg, .pdf)")
    plt.close("all")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for name, points in curves(costs, failures, step_s, result).items():
            line, = ax.plot([x for x, _ in points], [g * 100 for _, g in points], label=f"{name} interval")
            t = result.tier(name)
            chosen = evaluate(costs, failures, {u.name: u.interval_s for u in result.tiers}, step_s,
                              method=result.method).goodput
            ax.plot([t.interval_s], [chosen * 100], "o", color=line.get_color())
        ax.axhline(result.baseline_goodput * 100, ls="--", color="grey",
                   label=f"baseline (persistent only, every {result.baseline_interval_s:.3g} s)")
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint interval of the tier (s; the other tiers at the plan's)")
        ax.set_ylabel("goodput (%)")
        ax.set_title("tierckpt plan: goodput against each tier's interval (dots: the plan)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
