"""hydra/sweeper=optuna with a study that outlives its launcher.

launch.py swaps Optuna's sweeper class for this one when it runs through our launcher. The
search (sampler, direction, params, n_trials, n_jobs, max_failure_rate, storage) is Optuna's
own, configured as its plugin documents; what changes is what happens around an interruption:
- The study is stored in the sweep dir (`optuna.db`, SQLite) unless `storage` names another.
- Run the same command again with the same `hydra.sweep.dir` and the study continues: trials
  whose jobs were submitted are waited for (local ones resume from their checkpoint), and only
  the trials still missing from `n_trials` are asked for. No trial is submitted twice.
- A failed trial is told to Optuna as failed, never as a number; more failures in a batch than
  `max_failure_rate` allows end the search with one line.

No `from __future__ import annotations`, and optuna imported only inside methods: Hydra imports
every module here while it discovers plugins, with or without the optuna extra installed.
"""

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper

DEFAULT_STUDY = "search"


class StudySweeper(Sweeper):
    def __init__(self, **options: Any) -> None:
        # optuna 2.x on SQLAlchemy 1.4 (pinned: its storage needs it) warns of SQLAlchemy 2.0 at import
        os.environ.setdefault("SQLALCHEMY_SILENCE_UBER_WARNING", "1")
        from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

        options.pop("_target_", None)
        self.impl = OptunaSweeperImpl(**options)
        self.launcher: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher = self.impl.launcher
        if not hasattr(self.launcher, "wait_for"):
            fail("hydra/sweeper=optuna through launch.py needs hydra/launcher=hpc_array")

    def sweep(self, arguments: list[str]) -> None:
        try:
            self._sweep(arguments)
        except KeyboardInterrupt:
            print(f"interrupted: submitted trials go on; to continue the study: {resume_command(self.launcher.sweep_dir())}", file=sys.stderr)
            sys.exit(130)

    def _sweep(self, arguments: list[str]) -> None:
        import optuna

        from hpc.config.search import search_arguments
        from hpc.submit.sweep import read_record
        from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

        impl = self.impl
        sweep_dir: Path = self.launcher.sweep_dir()
        record = read_record(sweep_dir)
        earlier = record.get("search", {}).get("command")
        if earlier is not None and earlier != search_arguments(sys.argv[1:]):
            fail(f"{sweep_dir} holds a study of another command ({shlex.join(earlier)}): run that one, or choose a new hydra.sweep.dir")
        impl._process_searchspace_config()
        distributions, fixed = create_params_from_overrides([*impl._parse_sweeper_params_config(), *arguments])
        distributions = {**(impl.search_space_distributions or {}), **distributions}
        for name in fixed:
            distributions.pop(name, None)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        storage = impl.storage or f"sqlite:///{sweep_dir / 'optuna.db'}"
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens
        name, directions = impl.study_name or DEFAULT_STUDY, impl._get_directions()
        study = optuna.create_study(study_name=name, storage=storage, sampler=impl.sampler, directions=directions, load_if_exists=True)
        if study.trials:  # continued: a sampler seeded as before would ask the first trials' values again
            study.sampler.reseed_rng()
        print(f"study {name!r} in {storage}: {len(study.trials)} trials so far")
        print(f"if this launcher is interrupted, continue the study with: {resume_command(sweep_dir)}")

        ran = {int(p["trial"]): p for p in record["points"] if p.get("trial") is not None}
        self._finish_unfinished(study, ran)
        done = sum(1 for t in study.trials if t.number in ran and t.state.is_finished())
        next_num = max((int(p["num"]) for p in record["points"]), default=-1) + 1
        to_go = impl.n_trials - done
        while to_go > 0:
            trials = [study.ask() for _ in range(min(impl.n_jobs, to_go))]
            overrides = impl._configure_trials(trials, distributions, fixed)
            returns = self.launcher.launch(overrides, initial_job_idx=next_num, trials=[t.number for t in trials])
            next_num += len(returns)
            outcomes = [ret.return_value if ret.status.name == "COMPLETED" else None for ret in returns]
            errors = [str(ret._return_value) for ret in returns if ret.status.name != "COMPLETED"]
            for trial, value in zip(trials, outcomes, strict=True):
                tell(study, trial.number, value)
            if errors and len(errors) / len(returns) > impl.max_failure_rate:
                fail(f"{len(errors)} of {len(returns)} trials of the last batch failed (hydra.sweeper.max_failure_rate={impl.max_failure_rate}); {errors[0]}")
            to_go -= len(trials)
        self._report(study, sweep_dir)

    def _finish_unfinished(self, study: Any, ran: dict[int, dict[str, Any]]) -> None:
        """Trials an interrupted launcher left RUNNING in the study: those it had submitted are
        waited for; one it asked for but never submitted is closed as failed (and not counted)."""
        import optuna

        unfinished = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
        for trial in unfinished:
            if trial.number not in ran:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        submitted = [t.number for t in unfinished if t.number in ran]
        if not submitted:
            return
        print(f"waiting for the {len(submitted)} trial(s) the previous launcher submitted")
        outcomes = self.launcher.wait_for([int(ran[number]["num"]) for number in submitted])
        for number in submitted:
            tell(study, number, outcomes[int(ran[number]["num"])].value)

    def _report(self, study: Any, sweep_dir: Path) -> None:
        from omegaconf import OmegaConf

        completed = [t for t in study.trials if t.value is not None]
        if not completed:
            fail(f"no trial of the study completed; see python -m hpc.status {sweep_dir}")
        best = study.best_trial
        OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": best.params, "best_value": best.value}), sweep_dir / "optimization_results.yaml")
        params = " ".join(f"{key}={value}" for key, value in best.params.items())
        print(f"best of {len(completed)} completed trials: trial {best.number} ({params}): {best.value:.6g}; python -m hpc.report {sweep_dir}")


def tell(study: Any, number: int, value: float | None) -> None:
    import optuna

    if value is None:
        study.tell(number, state=optuna.trial.TrialState.FAIL)
    else:
        study.tell(number, float(value))


def resume_command(sweep_dir: Path) -> str:
    """This very command, with the sweep dir it writes (the default one names the time)."""
    from hpc.config.search import STUDY_SWEEPER

    args = [a for a in sys.argv[1:] if a != f"hydra.sweeper._target_={STUDY_SWEEPER}" and not a.startswith("hydra.sweep.dir=")]
    return shlex.join(["python", sys.argv[0], *args, f"hydra.sweep.dir={sweep_dir}"])


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
