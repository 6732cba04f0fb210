"""Scaling report of a sweep: throughput, speedup, efficiency and the final metric per run.

    python -m hpc.report SWEEP_DIR        prints the table; writes report.md, report.json,
                                          scaling.png, loss.png and parameters.png into SWEEP_DIR

Runs are named by what the sweep varied (`optim.lr=0.1`), one column per swept key.
Throughput is the mean samples/s over a run's epochs, leaving out the first when there are
more (start-up and first-touch costs). Only when the rank count varies: speedup against the mean
throughput of the runs with the fewest ranks, efficiency = speedup / (ranks / those fewest
ranks), and scaling.png; between runs on equal ranks these numbers would mean nothing.
A second table gives every interruption of every run (preemption, time limit, failure): each
stretch from the cause to the first resumed step, and the steps redone.
A hyperparameter search (sweep.json's "search") gets a trials table first, best first by its
objective (`failed`: ended without one, `-`: not reported yet), in report.json under "searches"
(report.json is then {"runs": [...], "searches": [...]}, a plain sweep's stays the list of runs),
and objective.png: each trial's value and the best so far.
A grid's points are ranked by its objective (`sweep.objective`, else the validation accuracy or
loss), best first and marked; parameters.png plots that objective against each swept value (a
search's: its objective, in its sweep dir), and loss.png puts each run's validation curve of it
beside the training loss.
Login-node code: no torch.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.interruptions import TIMELINE, costs
from hpc.objective import objective_direction, objective_value, validation_metrics
from hpc.rundir import RunDir, find_runs, read_jsonl
from hpc.shown import shown_value
from hpc.tools.status import RunStatus, SearchRecord, by_search, newest_epoch_end, ranked, searches, statuses_of, swept_label, swept_values, trial_outcome
from hpc.tools.sweep_plots import draw_validation, validation_curves, write_parameter_plot
from trainers.reporting.reporter import four_places


@dataclass(frozen=True)
class RunFigures:
    run: str  # the run directory's name (the sweep point number)
    ranks: int
    nodes: int | None
    samples_per_s: float
    speedup: float | None  # None when every run has the same rank count
    efficiency: float | None
    val: dict[str, float]  # the last validation's metrics by the task's names (val_accuracy -> "accuracy"), not its loss
    loss: float | None
    swept: dict[str, str]  # the overrides that set this sweep point apart ({} for a lone run)

    @property
    def label(self) -> str:
        return swept_label(self.swept) or self.run


def throughput(epochs: list[dict[str, Any]]) -> float:
    rates = [float(e["samples_per_s"]) for e in epochs if e.get("samples_per_s")]
    steady = rates[1:] if len(rates) > 1 else rates
    return sum(steady) / len(steady) if steady else 0.0


def scaling_figures(runs: list[RunDir]) -> list[RunFigures]:
    """Figures for the runs that reported at least one epoch; the others are left out."""
    swept = swept_values(runs)
    measured = []
    for run in runs:
        epochs = read_jsonl(run.metrics)
        if not epochs:
            continue
        result = json.loads(run.result.read_text()) if run.result.is_file() else {}
        last = newest_epoch_end(epochs) or epochs[-1]  # a script's run has no epoch's end: its last record
        ranks = int(last.get("world_size") or result.get("world_size") or 0)
        if ranks < 1:
            continue
        measured.append((run, ranks, result.get("num_nodes"), throughput(epochs), validated(last), last.get("loss")))
    if not measured:
        return []
    fewest = min(m[1] for m in measured)
    scaling = len({m[1] for m in measured}) > 1
    base_rates = [m[3] for m in measured if m[1] == fewest]
    base = sum(base_rates) / len(base_rates)
    figures = []
    for run, ranks, nodes, rate, val, loss in measured:
        speedup = (rate / base if base > 0 else 0.0) if scaling else None
        efficiency = speedup / (ranks / fewest) if speedup is not None else None
        figures.append(RunFigures(run.path.name, ranks, nodes, rate, speedup, efficiency, val, loss, swept.get(run.path, {})))
    return sorted(figures, key=lambda f: (f.ranks, f.run))


@dataclass(frozen=True)
class GridRanking:
    """A grid sweep's points ranked by its objective: `sweep.objective` where the sweep set one,
    else the validation accuracy where the runs report one, else the validation loss."""

    objective: str
    direction: str  # "maximize" or "minimize"
    values: dict[str, float]  # run name -> the objective from its result.json; a run without one is left out

    def order(self, figures: list[RunFigures]) -> list[RunFigures]:
        """Best first (ties by run name), then the runs without a value."""
        sign = -1.0 if self.direction == "maximize" else 1.0
        return sorted(figures, key=lambda f: (f.run not in self.values, sign * self.values.get(f.run, 0.0), natural(f.run)))


def natural(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 62, name)


def grid_ranking(runs: list[RunDir]) -> GridRanking | None:
    """How a grid's points rank (see GridRanking); None without a figure to rank them by."""
    import yaml

    results = {run.path.name: _read_json(run.result) for run in runs}
    chosen = None
    for run in runs:  # the sweep's own objective: every point's config.yaml carries it
        try:
            config = yaml.safe_load(run.config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        sweep = config.get("sweep") if isinstance(config, dict) else None
        if isinstance(sweep, dict) and isinstance(sweep.get("objective"), str):
            chosen = sweep["objective"]
            break
    if chosen is None:
        reported = {name for result in results.values() for name in validation_metrics(result)}
        chosen = "val_accuracy" if "accuracy" in reported else "val_loss" if "loss" in reported else None
    if chosen is None:
        return None
    values = {name: value for name, result in results.items() if (value := objective_value(result, chosen)) is not None}
    return GridRanking(chosen, objective_direction(chosen) or "minimize", values) if values else None


def validated(epoch: dict[str, Any]) -> dict[str, float]:
    """An epoch record's validation metrics by the task's names, its loss left out: val_<name>,
    or test_<name> in a run written before the validation split was named."""
    prefix = "val_" if any(key.startswith("val_") for key in epoch) else "test_"
    return {key.removeprefix(prefix): float(value) for key, value in epoch.items() if key.startswith(prefix) and key != f"{prefix}loss"}


def varies_ranks(figures: list[RunFigures]) -> bool:
    return len({f.ranks for f in figures}) > 1


def render_table(figures: list[RunFigures], ranking: GridRanking | None = None) -> str:
    """Markdown: run, ranks, nodes, one column per swept key, samples/s, speedup and efficiency
    (only when the rank count varies), the task's validation metrics (val accuracy, ...), loss.
    With a `ranking` (a grid that does not vary the rank count), the rows best first, the
    objective's column after the swept keys and the best run marked."""
    if ranking is not None:
        figures = ranking.order(figures)
    keys = list(dict.fromkeys(key for f in figures for key in f.swept))
    tested = list(dict.fromkeys(name for f in figures for name in f.val))
    scaling = varies_ranks(figures)
    val_names = [f"val {name.replace('_', ' ')}" for name in tested]
    ranked = [f"{ranking.objective} ({ranking.direction})"] if ranking is not None else []
    names = ["run", "ranks", "nodes", *keys, *ranked, "samples/s", *(["speedup", "efficiency"] if scaling else []), *val_names, "loss"]
    align = ["---", "---:", "---:", *["---"] * len(keys), *["---:"] * (len(names) - 3 - len(keys))]
    lines = [_row(names), _row(align)]
    for i, f in enumerate(figures):
        metrics = ["-" if name not in f.val else four_places(f.val[name]) for name in tested]
        loss = "-" if f.loss is None else four_places(f.loss)
        ratios = [f"{f.speedup:.2f}", f"{f.efficiency:.2f}"] if scaling and f.speedup is not None and f.efficiency is not None else []
        objective = [four_places(ranking.values[f.run]) if f.run in ranking.values else "-"] if ranking is not None else []
        run = f"{f.run} (best)" if ranking is not None and i == 0 and f.run in ranking.values else f.run
        swept = [shown_value(f.swept.get(key, "-")) for key in keys]
        cells = [run, str(f.ranks), str(f.nodes or "-"), *swept, *objective, f"{f.samples_per_s:.1f}", *ratios, *metrics, loss]
        lines.append(_row(cells))
    return "\n".join(lines)


@dataclass(frozen=True)
class TrialFigures:
    """A search trial's row: what the sweeper tried and what it scored."""

    run: str  # the run directory's name (the sweep point number)
    point: int
    trial: int | None  # Optuna's trial number; None where the sweeper gave none
    swept: dict[str, str]
    value: float | None  # the objective; None: failed, or not reported yet (see outcome)
    outcome: str  # "completed", "failed" or "running or waiting" (hpc.tools.status.trial_outcome)
    val: dict[str, float]  # result.json's validation metrics by the task's names, its loss included
    samples_per_s: float | None  # result.json's: the last epoch's throughput, all ranks

    @property
    def label(self) -> str:
        return swept_label(self.swept) or self.run


def search_trials(runs: list[RunDir]) -> list[tuple[SearchRecord, list[TrialFigures]]]:
    """Each search among the sweeps of `runs` with its trials, best first; [] for plain sweeps,
    which ask Slurm nothing (a trial's state tells a failed one from one still to report)."""
    if not searches(runs):
        return []
    swept = swept_values(runs)
    tables = []
    for trials in by_search(statuses_of(runs)).values():
        search = trials[0].search
        assert search is not None, "by_search() gives search trials"
        tables.append((search, [trial_row(status, search, swept.get(status.run_dir, {})) for status in ranked(trials)]))
    return tables


def trial_row(status: RunStatus, search: SearchRecord, swept: dict[str, str]) -> TrialFigures:
    result = _read_json(RunDir(status.run_dir).result)
    numbers = {str(key): _number(value) for key, value in validation_metrics(result).items()}
    return TrialFigures(
        status.run_dir.name,
        search.point(status.run_dir),
        search.trial(status.run_dir),
        swept,
        status.value,
        trial_outcome(status.value, status.state),
        {key: value for key, value in numbers.items() if value is not None},
        _number(result.get("samples_per_s")),
    )


def _number(value: Any) -> float | None:
    """A finite number from JSON, else None (a bool is no figure)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # a trial still running has no result.json yet
        return {}
    return data if isinstance(data, dict) else {}


def render_trials(search: SearchRecord, rows: list[TrialFigures]) -> str:
    """Markdown, one row per trial in the order given (best first): point, trial, one column per
    swept key, the objective (`failed`, or `-` while not reported), the validation metrics, samples/s."""
    keys = list(dict.fromkeys(key for row in rows for key in row.swept))
    tested = list(dict.fromkeys(name for row in rows for name in row.val))
    names = ["point", "trial", *keys, f"{search.objective} ({search.direction})", *(f"val {name.replace('_', ' ')}" for name in tested), "samples/s"]
    lines = [_row(names), _row(["---:", "---:", *["---"] * len(keys), "---:", *["---:"] * len(tested), "---:"])]
    for row in rows:
        value = four_places(row.value) if row.value is not None else "failed" if row.outcome == "failed" else "-"
        metrics = ["-" if name not in row.val else four_places(row.val[name]) for name in tested]
        rate = "-" if row.samples_per_s is None else f"{row.samples_per_s:.1f}"
        trial = "-" if row.trial is None else str(row.trial)
        lines.append(_row([str(row.point), trial, *(row.swept.get(key, "-") for key in keys), value, *metrics, rate]))
    return "\n".join(lines)


def best_so_far(values: Sequence[float], direction: str) -> list[float]:
    """The best value among the first 1, 2, ... of `values` (the direction's better side)."""
    better = max if direction == "maximize" else min
    best: list[float] = []
    for value in values:
        best.append(value if not best else better(best[-1], value))
    return best


INTERRUPTION_COLUMNS = (
    ("signal->stop", "to_stop_s"),
    ("->commit", "to_commit_s"),
    ("->exit", "to_exit_s"),
    ("->relaunch", "relaunch_s"),
    ("held", "held_s"),
    ("queued", "queued_s"),
    ("start-up", "start_up_s"),
    ("load", "load_s"),
    ("first step", "first_step_s"),
    ("total", "total_s"),
)


def render_interruptions(runs: list[RunDir]) -> str | None:
    """Markdown, one row per interruption of every run (rank 0's timeline, hpc.interruptions):
    its cause, how the run came back, the seconds of each stretch from the cause to the first
    resumed step (Slurm's requeue hold and the queue wait apart), and the steps redone. None
    when no run was interrupted."""
    rows = [(run, number, cost) for run in runs for number, cost in enumerate(costs(read_jsonl(run.path / TIMELINE)), 1)]
    if not rows:
        return None
    names = ["run", "#", "cause", "how", *(name for name, _ in INTERRUPTION_COLUMNS), "steps redone"]
    lines = [_row(names), _row(["---", "---:", "---", "---", *["---:"] * len(INTERRUPTION_COLUMNS), "---:"])]
    for run, number, cost in rows:
        seconds = ["-" if cost.get(key) is None else f"{float(cost[key]):.1f}" for _, key in INTERRUPTION_COLUMNS]
        lines.append(_row([run.path.name, str(number), str(cost["cause"]).replace("|", "/"), str(cost["how"]), *seconds, str(cost["redone_steps"])]))
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def write_plots(
    figures: list[RunFigures], runs: list[RunDir], out: Path, tables: Sequence[tuple[SearchRecord, list[TrialFigures]]] = (), ranking: GridRanking | None = None
) -> list[Path]:
    """scaling.png (rank counts that vary), loss.png (training loss, and beside it the validation
    figure the points are ranked by), parameters.png (that figure against each swept value: a
    grid's in `out`, a search's in its sweep dir), objective.png (a search's trials in order)."""
    import matplotlib

    matplotlib.use("Agg")  # login nodes have no display
    import matplotlib.pyplot as plt

    if not varies_ranks(figures):
        (out / "scaling.png").unlink(missing_ok=True)  # from an earlier report: it would mislead now
    plots = [write_scaling_plot(figures, out / "scaling.png", plt)] if varies_ranks(figures) else []
    labels = {f.run: f.label for f in figures}
    ranked_by = ranking.objective if ranking is not None else tables[0][0].objective if tables else "val_loss"
    validation = ranked_by if ranked_by.startswith("val_") else "val_loss"
    curves = validation_curves(runs, validation)
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(12 if curves else 6, 4), squeeze=False)
    ax = axes[0][0]
    for run in runs:
        steps = [(r["step"], r["loss"]) for r in read_jsonl(run.steps) if "step" in r and "loss" in r]
        if steps:
            ax.plot(*zip(*steps, strict=True), label=labels.get(run.path.name, run.path.name))
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title="loss", yscale="log")
    ax.legend(title="run", fontsize="small")
    if curves:
        draw_validation(axes[0][1], curves, validation, labels)
    fig.tight_layout()
    loss = out / "loss.png"
    fig.savefig(loss, dpi=100)
    plt.close(fig)
    objective = [path for search, rows in tables if (path := write_objective_plot(search, rows, search.sweep_dir / "objective.png", plt))]
    by_value = [
        write_parameter_plot(
            [(row.swept, row.value) for row in rows if row.value is not None], search.objective, search.direction, search.sweep_dir / "parameters.png", plt
        )
        for search, rows in tables
    ]
    if ranking is not None:
        points = [(f.swept, ranking.values[f.run]) for f in figures if f.run in ranking.values]
        by_value.append(write_parameter_plot(points, ranking.objective, ranking.direction, out / "parameters.png", plt))
    return [*plots, loss, *objective, *(path for path in by_value if path is not None)]


def write_objective_plot(search: SearchRecord, rows: list[TrialFigures], path: Path, plt: Any) -> Path | None:
    """Each reported trial's objective against its point number, and a step line of the best so
    far; failed trials and those still to report are left out. None when no trial has a value."""
    reported = sorted((row.point, row.value) for row in rows if row.value is not None)
    if not reported:
        path.unlink(missing_ok=True)  # from an earlier report: it would show trials that are not there
        return None
    from matplotlib.ticker import MaxNLocator

    points, values = [p for p, _ in reported], [v for _, v in reported]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(points, values, "o", label="trial")
    ax.step(points, best_so_far(values, search.direction), where="post", label="best so far")
    ax.set(xlabel="trial (sweep point)", ylabel=search.objective, title=f"{search.objective} ({search.direction})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_scaling_plot(figures: list[RunFigures], path: Path, plt: Any) -> Path:
    fig, (ax_rate, ax_eff) = plt.subplots(1, 2, figsize=(10, 4))
    ranks = [f.ranks for f in figures]
    ax_rate.plot(ranks, [f.samples_per_s for f in figures], "o-")
    ax_rate.set(
        xlabel="ranks", ylabel="samples/s", title="throughput", xscale="log", xticks=sorted(set(ranks)), xticklabels=[str(r) for r in sorted(set(ranks))]
    )
    ax_eff.plot(ranks, [f.efficiency for f in figures], "o-")
    ax_eff.axhline(1.0, color="grey", linewidth=0.5)
    ax_eff.set(
        xlabel="ranks",
        ylabel="speedup / rank ratio",
        title="scaling efficiency",
        xscale="log",
        ylim=(0, 1.2),
        xticks=sorted(set(ranks)),
        xticklabels=[str(r) for r in sorted(set(ranks))],
    )
    for ax in (ax_rate, ax_eff):
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # the log axis's own labels between the rank counts
        ax.grid(True, alpha=0.3)
    ax_rate.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def search_json(search: SearchRecord, rows: list[TrialFigures]) -> dict[str, Any]:
    """A search's part of report.json: what it optimised and its trials, best first."""
    trials = [{**asdict(row), "label": row.label} for row in rows]
    return {"sweep_dir": str(search.sweep_dir), "objective": search.objective, "direction": search.direction, "trials": trials}


def main(argv: list[str]) -> int:
    from hpc.cli import Parser

    parser = Parser("python -m hpc.report", __doc__ or "")
    parser.add_argument("sweep_dir", metavar="SWEEP_DIR", help="the sweep (or run) dir to report on; the files are written into it")
    named: str = parser.parse_args(argv).sweep_dir
    out = Path(named)
    try:
        if not named:  # Path("") is the current dir: the report would be written there
            raise UserError("SWEEP_DIR is empty (an unset shell variable?): name the sweep or run dir to report on")
        runs = find_runs(out)
        figures = scaling_figures(runs)
        if not figures:
            raise UserError(f"no run under {out} has reported an epoch yet (metrics.jsonl); try again when one has")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    tables = search_trials(runs)
    ranking = grid_ranking(runs) if not varies_ranks(figures) and not tables else None  # a search ranks its trials itself
    table = render_table(figures, ranking)
    interruptions = render_interruptions(runs)
    if interruptions is not None:
        table += "\n\nInterruptions (seconds from the cause to the first resumed step):\n\n" + interruptions
    # A search's question is which trial won: its trials come first.
    trials = [f"Trials of the search {search.sweep_dir}, best first:\n\n{render_trials(search, rows)}" for search, rows in tables]
    if trials:
        table = "\n\n".join([*trials, "Runs:\n\n" + table])
    (out / "report.md").write_text(table + "\n")
    written: Any = [{**asdict(f), "label": f.label} for f in figures]
    if tables:
        written = {"runs": written, "searches": [search_json(search, rows) for search, rows in tables]}
    (out / "report.json").write_text(json.dumps(written, indent=2) + "\n")
    lines = [table]
    if not varies_ranks(figures):
        lines.append(f"every run has {figures[0].ranks} ranks: no speedup, efficiency or scaling plot")
    try:
        plots = write_plots(figures, runs, out, tables, ranking)
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        plots = []
    lines.append("wrote " + ", ".join(str(p) for p in [out / "report.md", out / "report.json", *plots]))
    print_all(lines)
    return 0


def print_all(lines: list[str]) -> None:
    """The report on stdout, written after its files: `| head` may close the pipe early, which
    must cost neither the files nor a BrokenPipeError traceback."""
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush goes nowhere


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
