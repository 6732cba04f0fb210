"""What the tests of a real Optuna study share: the command, and reading back the study."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpc.launching.study import study_storage
from hpc.objective import objective_value
from tests.support.runs import ROOT

# Optuna's TPE with a seed asks the same learning rates every time; training is bit-exact.
SEARCH = (
    "hydra/sweeper=optuna",
    "hydra.sweeper.direction=maximize",
    "hydra.sweeper.sampler.seed=7",
    "hydra.sweeper.n_trials=4",
    "hydra.sweeper.n_jobs=2",
    "optim.lr=tag(log,interval(0.003,0.5))",
    "sweep.objective=val_accuracy",
)


def launch_command(*args: str, sweep_dir: Path) -> list[str]:
    return [sys.executable, str(ROOT / "launch.py"), "-m", *SEARCH, *args, f"run_root={sweep_dir.parent}", f"hydra.sweep.dir={sweep_dir}"]


def run_search(*args: str, sweep_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(launch_command(*args, sweep_dir=sweep_dir), capture_output=True, text=True, timeout=timeout, cwd=sweep_dir.parent)


def sweep_points(sweep_dir: Path) -> list[dict[str, Any]]:
    path = sweep_dir / "sweep.json"
    return json.loads(path.read_text())["points"] if path.exists() else []


def check_study(sweep_dir: Path, trials: int) -> dict[int, float]:
    """The study in the sweep dir (its journal file) against the runs: `trials` finished trials, each run once, each
    told the objective its run reported. Returns the objective by trial number."""
    import optuna

    study = optuna.load_study(study_name="search", storage=study_storage(None, sweep_dir)[0])
    points = sweep_points(sweep_dir)
    assert sorted(p["num"] for p in points) == list(range(trials)), points
    assert sorted(p["trial"] for p in points) == sorted({p["trial"] for p in points}), "a trial submitted twice"
    values = {}
    for point in points:
        result = json.loads((Path(point["run_dir"]) / "result.json").read_text())
        values[point["trial"]] = objective_value(result, "val_accuracy")
    asked = [tuple(sorted(t.params.items())) for t in study.trials if t.number in values]
    assert len(set(asked)) == len(asked), f"a continued study asked the same values again: {asked}"
    told = {t.number: t.value for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert told == values, (told, values)
    assert study.best_value == max(values.values())
    return values
