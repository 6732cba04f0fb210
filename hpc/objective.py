"""`sweep.objective`: the figure a trial of a hyperparameter search returns to its sweeper.

It names a number the run already writes to result.json:
    loss             the final training loss (mean over ranks)
    samples_per_s    training throughput, all ranks
    val_<metric>     the last validation's metric by the task's name: val_accuracy, val_loss,
                     val_perplexity (lm), or a user task's own

Never the held-out test split's figures (result.json's test_metrics): a search tuned on them
would make them a second validation split. Runs written before the validation split was named
keep their validation figures as test_metrics (no val_metrics beside it): val_<metric> reads them.

Pure functions, no torch: launch.py checks the name, the launcher reads the value, and
hpc.status / hpc.report rank the trials with them.
"""

from __future__ import annotations

import math
import re
from typing import Any

# What each built-in task's evaluation reports (its summarize() included).
BUILTIN_VAL_METRICS = {"classify": ("accuracy", "loss"), "lm": ("loss", "perplexity")}
TOP_LEVEL = ("loss", "samples_per_s")
# The direction a known figure is optimised in; a user's own metric has none known.
DIRECTIONS = {"accuracy": "maximize", "acc": "maximize", "samples_per_s": "maximize", "loss": "minimize", "perplexity": "minimize"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def objective_names(task: str | None) -> list[str]:
    """The objectives a built-in task ("classify", "lm") reports; None: a user's task."""
    return [*TOP_LEVEL, *(f"val_{m}" for m in BUILTIN_VAL_METRICS.get(task or "", ()))]


def check_objective(name: str, task: str | None) -> str | None:
    """Why `name` is no objective these runs report (one line), or None when it is one. A user
    task's evaluation metrics are known only once it ran: any val_<name> passes here."""
    if name.startswith("test_"):
        return f"sweep.objective={name}: a search must not tune on the held-out test split; use val_{name.removeprefix('test_')} (the validation split's)"
    if task in BUILTIN_VAL_METRICS:
        known = objective_names(task)
        return None if name in known else f"sweep.objective={name}: task={task} runs report {', '.join(known)}"
    if name in TOP_LEVEL or (name.startswith("val_") and _NAME.fullmatch(name.removeprefix("val_"))):
        return None
    return f"sweep.objective={name}: choose loss, samples_per_s or val_<a metric your task's eval_step returns>"


def objective_direction(name: str) -> str | None:
    """'maximize' or 'minimize' for a figure whose better side is known (accuracy, loss, ...)."""
    return DIRECTIONS.get(name.removeprefix("val_").removeprefix("test_"))


def validation_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """A result.json's validation figures: val_metrics, or test_metrics in a run written before
    the validation split was named (no val_metrics beside it)."""
    figures = result.get("val_metrics", result.get("test_metrics"))
    return figures if isinstance(figures, dict) else {}


def objective_value(result: dict[str, Any], name: str) -> float | None:
    """The objective in a run's result.json; None when the run did not report it (or not as a
    finite number). test_<metric>, refused for new searches, still reads an old study's runs."""
    if name.startswith("val_"):
        value = validation_metrics(result).get(name.removeprefix("val_"))
    elif name.startswith("test_") and isinstance(result.get("test_metrics"), dict):
        value = result["test_metrics"].get(name.removeprefix("test_"))
    else:
        value = result.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def reported_objectives(result: dict[str, Any]) -> list[str]:
    """Every objective name a result.json offers (for the message when one is missing)."""
    names = [key for key in TOP_LEVEL if objective_value(result, key) is not None]
    return names + [f"val_{key}" for key in sorted(validation_metrics(result)) if objective_value(result, f"val_{key}") is not None]
