"""hpc.report's plots of what a sweep found: its objective against each swept parameter
(parameters.png), and each run's validation curve beside its training loss (loss.png). What
is plotted comes from pure functions; matplotlib only draws it. Login-node code: no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc.rundir import RunDir, read_jsonl
from hpc.shown import shown_value


@dataclass(frozen=True)
class ParameterAxis:
    """One swept key: its value at each point that set it, and the objective there."""

    key: str
    values: list[float] | list[str]  # numbers where every value is one, else the values as shown
    objective: list[float]
    log: bool  # positive numbers spanning a factor of 10 or more (learning rates): a log axis

    def best_at(self, best: dict[str, str]) -> float | str | None:
        """Where the best point sits on this axis (None: it does not set this key)."""
        if self.key not in best:
            return None
        return _number(best[self.key]) if self.values and isinstance(self.values[0], float) else shown_value(best[self.key])


def _number(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def parameter_axes(points: Sequence[tuple[dict[str, str], float]]) -> list[ParameterAxis]:
    """An axis per swept key, in the order the keys first appear; `points`: (swept values, objective)."""
    keys = list(dict.fromkeys(key for swept, _ in points for key in swept))
    axes = []
    for key in keys:
        having = [(swept[key], value) for swept, value in points if key in swept]
        numbers = [_number(text) for text, _ in having]
        objective = [value for _, value in having]
        if all(n is not None for n in numbers):
            found = [float(n) for n in numbers if n is not None]
            log = min(found) > 0 and max(found) / min(found) >= 10
            axes.append(ParameterAxis(key, found, objective, log))
        else:
            axes.append(ParameterAxis(key, [shown_value(text) for text, _ in having], objective, False))
    return axes


def best_point(points: Sequence[tuple[dict[str, str], float]], direction: str) -> dict[str, str]:
    better = max if direction == "maximize" else min
    return better(points, key=lambda point: point[1])[0]


def validation_curves(runs: Sequence[RunDir], name: str) -> dict[str, list[tuple[int, float]]]:
    """Each run's `name` (val_loss, val_accuracy, ...) at every evaluation, by step, from
    metrics.jsonl (epoch ends and trainer.eval_every's); runs that never reported it are left out."""
    curves = {}
    for run in runs:
        found = [(int(r["step"]), float(r[name])) for r in read_jsonl(run.metrics) if isinstance(r.get("step"), int) and isinstance(r.get(name), int | float)]
        if found:
            curves[run.path.name] = sorted(dict(found).items())  # a step evaluated again after a resume: its newest figure
    return curves


def write_parameter_plot(points: Sequence[tuple[dict[str, str], float]], objective: str, direction: str, path: Path, plt: Any) -> Path | None:
    """A panel per swept key: the objective at each value, the best point starred. None (and an
    old file removed) without a point that has both."""
    points = [(swept, value) for swept, value in points if swept]
    if not points:
        path.unlink(missing_ok=True)
        return None
    axes, best = parameter_axes(points), best_point(points, direction)
    fig, panels = plt.subplots(1, len(axes), figsize=(4 * len(axes), 3.6), squeeze=False)
    best_value = next(value for swept, value in points if swept is best)
    for panel, axis in zip(panels[0], axes, strict=True):
        panel.plot(axis.values, axis.objective, "o", label="point")
        where = axis.best_at(best)
        if where is not None:
            panel.plot([where], [best_value], "*", markersize=14, label="best")
        panel.set(xlabel=axis.key, ylabel=objective, xscale="log" if axis.log else "linear")
        panel.grid(True, alpha=0.3)
    panels[0][0].legend(fontsize="small")
    fig.suptitle(f"{objective} ({direction}) by swept value")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_validation(ax: Any, curves: dict[str, list[tuple[int, float]]], name: str, labels: dict[str, str]) -> None:
    for run, curve in curves.items():
        ax.plot(*zip(*curve, strict=True), "o-", markersize=3, label=labels.get(run, run))
    ax.set(xlabel="step", ylabel=name, title=f"validation: {name}")
    ax.legend(title="run", fontsize="small")
