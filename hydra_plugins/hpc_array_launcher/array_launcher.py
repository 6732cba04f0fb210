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

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from hpc.config.compose import composed_point
        from hpc.config.schema import to_job_config
        from hpc.errors import UserError
        from hpc.submit.sweep import SweepPoint, discard_unsubmitted, launch_sweep
        from hpc.submit.tidy import end_on_closed_stdout

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        nums = [initial_job_idx + offset for offset in range(len(job_overrides))]
        try:
            # launch.py composed every point already (its checks run before Hydra makes the sweep dir)
            jobs = [composed_point(overrides) or to_job_config(self._compose(overrides)) for overrides in job_overrides]
            points = [SweepPoint(num, tuple(overrides), job) for num, overrides, job in zip(nums, job_overrides, jobs, strict=True)]
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
        return [JobReturn(overrides=list(o), status=JobStatus.COMPLETED, _return_value=None) for o in job_overrides]

    def _compose(self, overrides: Sequence[str]) -> DictConfig:
        composed = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(composed):
            del composed["hydra"]
        return composed
