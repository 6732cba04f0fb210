#!/usr/bin/env python
"""Compose a job from Hydra configs, validate it, and run it locally or submit it to Slurm.

    python launch.py                                   # embedded default: 2 local MPI ranks
    python launch.py cluster=simulated resources.nodes=2 resources.tasks_per_node=2
    python launch.py dry_run=true cluster=simulated    # print config + sbatch, submit nothing
    python launch.py -m optim.lr=0.1,0.2 cluster=simulated sweep.max_parallel=1   # one job array
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hpc.config import RUN_ACCESS, apply_run_access, register_schemas, to_job_config
from hpc.errors import UserError
from hpc.launch import discard_run_dir, launch
from hpc.overrides import check_overrides, check_sweep
from hpc.rundir import RunDir
from hpc.spec import check_script_values

HYDRA_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--resolve", "-p", "--package"}
MULTIRUN_FLAGS = {"-m", "--multirun"}


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = RunDir(Path(HydraConfig.get().runtime.output_dir))
    try:
        job = to_job_config(cfg)
        code = launch(job, run_dir)
    except UserError as err:
        discard_run_dir(run_dir)
        fail(str(err), err.exit_code)
    if job.dry_run:
        discard_run_dir(run_dir)
    if code:
        sys.exit(code)


def cli() -> None:
    register_schemas()
    args = sys.argv[1:]
    if not HYDRA_INFO_FLAGS & set(args):
        overrides = [a for a in args if not a.startswith("-")]
        try:
            jobs = check_sweep(overrides) if MULTIRUN_FLAGS & set(args) else [check_overrides(overrides)]
            for job in jobs:
                check_script_values(job)  # before Hydra makes a directory of the name
            access = {job.run_access for job in jobs}
            if access - set(RUN_ACCESS):
                raise UserError(f"run_access={min(access - set(RUN_ACCESS))!r} is not one of {', '.join(RUN_ACCESS)}")
        except UserError as err:
            fail(str(err), err.exit_code)
        # Before Hydra creates the run (or sweep) dir: it and all in it get this access only.
        apply_run_access("private" if "private" in access else min(access))  # the strictest asked for
    main()


if __name__ == "__main__":
    cli()
