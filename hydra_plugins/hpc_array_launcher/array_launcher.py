"""The Hydra side of hpc.sweep: compose every point, hand them over, report job ids back.

No `from __future__ import annotations` here: Hydra executes plugin modules without registering
them in sys.modules, and dataclasses then cannot resolve string annotations."""

import shutil
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
        from hpc.config import to_job_config
        from hpc.errors import UserError
        from hpc.sweep import SweepPoint, launch_sweep

        assert self.config is not None and self.hydra_context is not None
        points = []
        for offset, overrides in enumerate(job_overrides):
            composed = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(composed):
                del composed["hydra"]
            points.append(SweepPoint(initial_job_idx + offset, tuple(overrides), to_job_config(composed)))
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        try:
            code = launch_sweep(points, sweep_dir)
        except UserError as err:
            _discard_if_empty(sweep_dir)
            print(f"error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
        if all(point.job.dry_run for point in points):
            _discard_if_empty(sweep_dir)
        if code:
            sys.exit(code)
        return [JobReturn(overrides=list(o), status=JobStatus.COMPLETED, _return_value=None) for o in job_overrides]


def _discard_if_empty(sweep_dir: Path) -> None:
    """Hydra's basic sweeper made the sweep dir and its multirun.yaml; with nothing submitted, go."""
    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
        shutil.rmtree(sweep_dir, ignore_errors=True)
