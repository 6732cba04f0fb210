"""The launch command: compose a job from Hydra configs, validate it, and run it locally or
submit it to Slurm. Installed as `hpc-launch`; `python launch.py` in a checkout is the same.

hpc-launch                                   # embedded default: 2 local MPI ranks
hpc-launch cluster=simulated resources.nodes=2 resources.tasks_per_node=2
hpc-launch dry_run=true cluster=simulated    # print config + sbatch, submit nothing
hpc-launch -m optim.lr=0.1,0.2 cluster=simulated sweep.max_parallel=1   # one job array

The built-in configs are package data (hpc/conf); `--config-dir DIR` adds a project's own.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hpc.config.compose import (
    CONF_DIR,
    ConfigSource,
    compose_job,
    compose_run,
    fixed_overrides,
    initialized,
    load_plugins,
    register_schemas,
    sweep_points,
    sweeper_config,
)
from hpc.config.schema import RUN_ACCESS, JobConfig, apply_run_access, to_job_config
from hpc.config.scripts import split_passthrough, with_script_args
from hpc.config.search import STUDY_SWEEPER, Search, check_search, is_basic
from hpc.config.validate import validate_job
from hpc.errors import UserError
from hpc.rundir import RunDir
from hpc.submit.launch import discard_run_dir, launch
from hpc.submit.tidy import end_on_closed_stdout, note_run_root, prune_empty

HERE = Path(__file__).resolve().parent  # Hydra takes a relative --config-path from hydra.main's module: this one


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def run(cfg: DictConfig, checked: JobConfig | None = None) -> None:
    """The job Hydra composed, in the run dir Hydra made for it (HydraConfig). `checked`: the
    same config, already typed and validated."""
    run_dir = RunDir(Path(HydraConfig.get().runtime.output_dir))
    try:
        job = checked or to_job_config(cfg)
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


main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(run)  # absolute: a file path, installed or not


def discard(run_dir: RunDir) -> None:
    """Remove the run dir if Hydra's files are all it holds, then the parents this command made."""
    discard_run_dir(run_dir)
    if not run_dir.path.exists():
        prune_empty(run_dir.path)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Hydra's own command-line parser: `--config-dir DIR` and `--config-dir=DIR` alike. A
    script's own options before `--` get a line saying where they go."""
    from hydra._internal.utils import get_args_parser

    args, unknown = get_args_parser().parse_known_args(argv)
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)} (a script's own arguments go after --: python launch.py script=train.py -- --lr 0.1)")
    return args


def config_source(args: argparse.Namespace) -> ConfigSource:
    """The primary config as Hydra will load it (a relative --config-path: from this module's directory)."""
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


def check_command(args: argparse.Namespace) -> tuple[list[JobConfig], Search | None]:
    """Every check a job gets, before Hydra makes a run (or sweep) dir: a refused command
    leaves nothing. Raises UserError with one line. A searching sweeper's run comes back too."""
    source = config_source(args)
    if not args.multirun:
        job = compose_job(args.overrides, source)
        validate_job(job)
        return [job], None
    sweeper = sweeper_config(fixed_overrides(args.overrides), source)
    search = None if is_basic(sweeper) else check_search(args.overrides, sweeper, source)
    points = search.points if search else sweep_points(args.overrides, source, sweeper)
    for num, (overrides, job) in enumerate(points):
        try:
            validate_job(job)
        except UserError as err:
            where = (
                f"the search space at {' '.join(o for o in overrides if o not in args.overrides)}"
                if search
                else f"sweep point #{num} ({' '.join(overrides) or 'no overrides'})"
            )
            raise UserError(f"{where}: {err}") from None
    return [job for _, job in points], search


def restrict_access(jobs: list[JobConfig]) -> None:
    """Before Hydra creates the run (or sweep) dir: it and all in it get this access only."""
    access = {job.run_access for job in jobs}
    if access - set(RUN_ACCESS):
        raise UserError(f"run_access={min(access - set(RUN_ACCESS))!r} is not one of {', '.join(RUN_ACCESS)}")
    for job in jobs:
        note_run_root(job.run_root)  # the folders a dry run may remove again stop here
    apply_run_access("private" if "private" in access else min(access))  # the strictest asked for


def run_single(args: argparse.Namespace, script_args: list[str] | None) -> bool:
    """One job with one Hydra composition: the config that is checked is the one that runs
    (hydra.main would compose it twice more: once for the run mode, once for the run). False,
    having done nothing, where the config itself asks for a multirun (hydra.mode=MULTIRUN)."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import open_dict, read_write

    try:
        source = config_source(args)
    except UserError as err:
        fail(str(err), err.exit_code)
    with initialized(source) as hydra_app:
        try:
            cfg = compose_run(hydra_app, args.overrides, source)
            if cfg.hydra.mode == RunMode.MULTIRUN:
                return False
            job = validated(cfg)
            job = with_script_args(job, script_args)
            restrict_access([job])
        except UserError as err:
            fail(str(err), err.exit_code)
        with read_write(cfg.hydra), open_dict(cfg.hydra):  # as Hydra's own run records it
            cfg.hydra.mode = RunMode.RUN
            cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=source.config_name)
        context = HydraContext(config_loader=hydra_app.config_loader, callbacks=callbacks)
        done = run_job(task_function=functools.partial(run, checked=job), config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None, hydra_context=context)
        callbacks.on_run_end(config=cfg, config_name=source.config_name, job_return=done)
        done.return_value  # noqa: B018  (re-raises what the run raised, as Hydra's own run does)
    return True


def validated(cfg: DictConfig) -> JobConfig:
    from omegaconf import OmegaConf, open_dict

    task = OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])
    with open_dict(task):
        job = to_job_config(task)
    validate_job(job)
    return job


def print_search(search: Search, job: JobConfig, command: list[str]) -> None:
    """`-m ... dry_run=true` with a searching sweeper: what each trial would run, nothing more."""
    direction = f" ({search.direction})" if search.direction else ""
    print(f"# hydra/sweeper={search.sweeper}: each trial returns sweep.objective={search.objective}{direction}")
    print(f"# the search space's edges, each composed and checked: {len(search.points)}")
    for overrides, _ in search.points:
        print(f"#   {' '.join(o for o in overrides if o not in command)}")
    where = "on local MPI ranks, one after another" if job.cluster.launcher == "local" else f"as one job array per batch on {job.cluster.name}"
    print(f"dry run: nothing submitted; trials would run {where}")


def cli() -> None:
    register_schemas()
    try:
        load_plugins()
    except UserError as err:
        fail(str(err), err.exit_code)
    argv, script_args = split_passthrough(sys.argv[1:])
    sys.argv[1:] = argv  # Hydra's own parsing (a multirun's) sees its arguments only
    try:
        args = parse_args(argv)
        if script_args is not None and (args.multirun or info_only(args)):
            raise UserError("arguments after -- go to a single run's script: with -m (or --cfg, --help) give the script's settings as script_args=[...]")
    except UserError as err:
        fail(str(err), err.exit_code)
    if not info_only(args) and not args.multirun:
        try:
            if run_single(args, script_args):
                sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
                return
        except BrokenPipeError:
            end_on_closed_stdout()
            return
    if not info_only(args):
        try:
            jobs, search = check_command(args)
            restrict_access(jobs)
        except UserError as err:
            fail(str(err), err.exit_code)
        if search and jobs[0].dry_run:
            print_search(search, jobs[0], args.overrides)
            return
        if search and search.sweeper == "optuna":  # the study outlives this process (hydra_plugins/hpc_array_launcher/study.py)
            sys.argv.append(f"hydra.sweeper._target_={STUDY_SWEEPER}")
    try:
        main()
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
    except BrokenPipeError:  # in Hydra's own printing (--help, --cfg); ours handle it in main()
        end_on_closed_stdout()
