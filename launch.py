#!/usr/bin/env python
"""Compose a job from Hydra configs, validate it, and run it locally or submit it to Slurm.

python launch.py                                   # embedded default: 2 local MPI ranks
python launch.py cluster=simulated resources.nodes=2 resources.tasks_per_node=2
python launch.py dry_run=true cluster=simulated    # print config + sbatch, submit nothing
python launch.py -m optim.lr=0.1,0.2 cluster=simulated sweep.max_parallel=1   # one job array
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hpc.config.compose import CONF_DIR, ConfigSource, compose_job, register_schemas, sweep_points
from hpc.config.schema import RUN_ACCESS, JobConfig, apply_run_access, to_job_config
from hpc.config.validate import validate_job
from hpc.errors import UserError
from hpc.rundir import RunDir
from hpc.submit.launch import discard_run_dir, launch
from hpc.submit.tidy import end_on_closed_stdout, note_run_root, prune_empty

HERE = Path(__file__).resolve().parent


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = RunDir(Path(HydraConfig.get().runtime.output_dir))
    try:
        job = to_job_config(cfg)
        code = launch(job, run_dir)
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
    except UserError as err:
        discard(run_dir)
        fail(str(err), err.exit_code)
    except BrokenPipeError:  # `launch.py dry_run=true | head -1`
        discard(run_dir)
        end_on_closed_stdout()
    if job.dry_run:
        discard(run_dir)
    if code:
        sys.exit(code)


def discard(run_dir: RunDir) -> None:
    """Remove the run dir if Hydra's files are all it holds, then the parents this command made."""
    discard_run_dir(run_dir)
    if not run_dir.path.exists():
        prune_empty(run_dir.path)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Hydra's own command-line parser: `--config-dir DIR` and `--config-dir=DIR` alike."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)


def config_source(args: argparse.Namespace) -> ConfigSource:
    """The primary config as Hydra will load it (--config-path is relative to this file)."""
    path = str(CONF_DIR)
    if args.config_path is not None:
        path = args.config_path if args.config_path.startswith("pkg://") else str((HERE / args.config_path).resolve())
    extra = None
    if args.config_dir is not None:
        extra = os.path.abspath(args.config_dir)
        if not os.path.isdir(extra):
            raise UserError(f"--config-dir {args.config_dir}: no such directory")
    return ConfigSource(path, args.config_name or "config", extra)


def info_only(args: argparse.Namespace) -> bool:
    """Hydra prints something (help, config, info) and runs nothing."""
    return bool(args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.experimental_rerun)


def check_command(args: argparse.Namespace) -> list[JobConfig]:
    """Every check a job gets, before Hydra makes a run (or sweep) dir: a refused command
    leaves nothing. Raises UserError with one line."""
    source = config_source(args)
    if not args.multirun:
        job = compose_job(args.overrides, source)
        validate_job(job)
        return [job]
    points = sweep_points(args.overrides, source)
    for num, (overrides, job) in enumerate(points):
        try:
            validate_job(job)
        except UserError as err:
            raise UserError(f"sweep point #{num} ({' '.join(overrides) or 'no overrides'}): {err}") from None
    return [job for _, job in points]


def cli() -> None:
    register_schemas()
    args = parse_args(sys.argv[1:])
    if not info_only(args):
        try:
            jobs = check_command(args)
            access = {job.run_access for job in jobs}
            if access - set(RUN_ACCESS):
                raise UserError(f"run_access={min(access - set(RUN_ACCESS))!r} is not one of {', '.join(RUN_ACCESS)}")
        except UserError as err:
            fail(str(err), err.exit_code)
        for job in jobs:
            note_run_root(job.run_root)  # the folders a dry run may remove again stop here
        # Before Hydra creates the run (or sweep) dir: it and all in it get this access only.
        apply_run_access("private" if "private" in access else min(access))  # the strictest asked for
    try:
        main()
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
    except BrokenPipeError:  # in Hydra's own printing (--help, --cfg); ours handle it in main()
        end_on_closed_stdout()


if __name__ == "__main__":
    cli()
