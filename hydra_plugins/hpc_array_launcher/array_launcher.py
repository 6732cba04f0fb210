"""The Hydra side of hpc.submit.sweep: compose every point, hand them over, report job ids back.

No `from __future__ import annotations` here: Hydra executes plugin modules without registering
them in sys.modules, and dataclasses then cannot resolve string annotations."""

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict


@dataclass
class ArrayLauncherConf:
    _target_: str = "hydra_plugins.hpc_array_launcher.array_launcher.ArrayLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="hpc_array", node=ArrayLauncherConf, provider="hpc-toolkit")


class ArrayLauncher(Launcher):
    def __init__(self) -> None:
        self.config: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, trials: Sequence[int] | None = None) -> Sequence[JobReturn]:
        """The basic sweeper's grid: submitted, and returned at once. A searching sweeper's batch
        (`trials`: their numbers in its study, where it has them): run, and waited for."""
        from hpc.config.search import is_basic

        if not is_basic(self._sweeper()):
            return self.run_trials(job_overrides, initial_job_idx, trials)
        from hpc.errors import UserError
        from hpc.submit.sweep import discard_unsubmitted, launch_sweep
        from hpc.submit.tidy import end_on_closed_stdout

        sweep_dir = self.sweep_dir()
        nums = [initial_job_idx + offset for offset in range(len(job_overrides))]
        try:
            points = self.points(job_overrides, initial_job_idx)
            code = launch_sweep(points, sweep_dir)
            sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
        except UserError as err:
            discard_unsubmitted(sweep_dir, nums)
            print(f"error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
        except BrokenPipeError:  # `launch.py -m ... | head -1`
            discard_unsubmitted(sweep_dir, nums)
            end_on_closed_stdout()
        discard_unsubmitted(sweep_dir, nums)  # a dry run: nothing went out
        if code:
            sys.exit(code)
        return [job_return(o, JobStatus.COMPLETED, None) for o in job_overrides]

    def run_trials(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, trials: Sequence[int] | None = None) -> list[JobReturn]:
        from hpc.submit.trials import run_batch

        points = self._or_exit(lambda: self.points(job_overrides, initial_job_idx, trials))
        search = self.search_record(points[0].job.sweep.objective)
        outcomes = self._or_exit(lambda: run_batch(points, self.sweep_dir(), search["objective"], search))
        return [trial_return(point.overrides, outcome) for point, outcome in zip(points, outcomes, strict=True)]

    def wait_for(self, nums: Sequence[int]) -> dict[int, Any]:
        """The outcomes (hpc.submit.trials.Outcome) of trials submitted by an earlier launcher of
        this sweep dir: Slurm's are waited for, local ones run on from their checkpoint."""
        from hpc.submit.sweep import read_record
        from hpc.submit.trials import wait_for

        sweep_dir = self.sweep_dir()
        entries = {p["num"]: p for p in read_record(sweep_dir)["points"] if p.get("num") in nums}
        points = self._or_exit(lambda: [p for num in nums for p in self.points([entries[num]["overrides"]], num, [entries[num].get("trial")])])
        objective = str(points[0].job.sweep.objective) if points else ""
        outcomes = self._or_exit(lambda: wait_for(points, sweep_dir, objective))
        return {outcome.num: outcome for outcome in outcomes}

    def points(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, trials: Sequence[int | None] | None = None) -> list[Any]:
        """hpc.submit.sweep.SweepPoint of each override list, numbered from initial_job_idx."""
        from hpc.config.compose import composed_point
        from hpc.config.schema import to_job_config
        from hpc.submit.sweep import SweepPoint

        numbers = list(trials) if trials is not None else [None] * len(job_overrides)
        points = []
        for offset, (overrides, trial) in enumerate(zip(job_overrides, numbers, strict=True)):
            # launch.py composed the basic sweeper's points already (its checks run before Hydra makes the sweep dir)
            job = composed_point(overrides) or to_job_config(self._compose(overrides))
            points.append(SweepPoint(initial_job_idx + offset, tuple(overrides), job, trial))
        return points

    def search_record(self, objective: str | None) -> dict[str, Any]:
        """What sweep.json says of the search: hpc.status ranks its trials with it."""
        from hpc.config.search import search_arguments, sweeper_direction, sweeper_name
        from hpc.objective import objective_direction

        sweeper = self._sweeper()
        direction = sweeper_direction(sweeper) or objective_direction(str(objective))
        name = sweeper_name(str(sweeper.get("_target_")))
        return {"sweeper": name, "objective": objective, "direction": direction, "command": search_arguments(sys.argv[1:])}

    def sweep_dir(self) -> Path:
        assert self.config is not None
        return Path(str(self.config.hydra.sweep.dir)).resolve()

    def _sweeper(self) -> dict[str, Any]:
        from omegaconf import OmegaConf

        assert self.config is not None
        node = OmegaConf.to_container(self.config.hydra.sweeper, resolve=False)
        return {str(k): v for k, v in node.items()} if isinstance(node, dict) else {}

    @staticmethod
    def _or_exit(work: Any) -> Any:
        """work(); a UserError ends the process with its one line (Hydra would print a traceback)."""
        from hpc.errors import UserError

        try:
            return work()
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)

    def _compose(self, overrides: Sequence[str]) -> DictConfig:
        composed = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(composed):
            del composed["hydra"]
        return composed


class TrialFailed(Exception):
    """A trial without an objective: its job failed, or its run did not report the figure."""


def trial_return(overrides: Sequence[str], outcome: Any) -> JobReturn:
    """A trial's outcome as Hydra's sweepers read it: the objective, or a failure (never a number)."""
    if outcome.value is not None:
        return job_return(overrides, JobStatus.COMPLETED, outcome.value)
    return job_return(overrides, JobStatus.FAILED, TrialFailed(f"trial #{outcome.num}: {outcome.error}"))


def job_return(overrides: Sequence[str], status: JobStatus, value: Any) -> JobReturn:
    """A JobReturn through its public `return_value` setter (a failure's value is its exception)."""
    done = JobReturn(overrides=list(overrides), status=status)
    done.return_value = value
    return done
