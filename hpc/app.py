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
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig

from hpc.config import show
from hpc.config.compose import (
    ARRAY_LAUNCHER,
    CONF_DIR,
    ConfigSource,
    compose_jobs,
    compose_run,
    fixed_overrides,
    initialized,
    load_plugins,
    multirun_config,
    register_schemas,
    sweep_points,
    sweeper_of,
)
from hpc.config.launchers import traits
from hpc.config.local_gpus import local_job, override_key
from hpc.config.schema import RUN_ACCESS, JobConfig, apply_run_access
from hpc.config.scripts import split_passthrough, with_script_args
from hpc.config.search import Search, check_search, is_basic
from hpc.errors import UserError
from hpc.launching.launch import discard_run_dir, launch, prepare
from hpc.launching.tidy import end_on_closed_stdout, note_run_root, prune_empty
from hpc.rundir import RunDir

HERE = Path(__file__).resolve().parent  # a relative --config-path is taken from here, as hydra.main takes it from its module


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def execute(job: JobConfig, run_dir: RunDir, note: str | None = None) -> None:
    """Run or submit the validated job from its run dir; exits with its code. `note`: what
    this machine changed in the job, the job's first log line (the console and launch.log)."""
    if note:
        logging.getLogger("hpc.launch").info(note)
    try:
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


class FlagsParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage and error
        raise UserError(message)


def flags_parser() -> argparse.ArgumentParser:
    """Hydra's command-line flags, as documented (`--help`, `--cfg`, `-m`, `--config-dir` ...)."""
    parser = FlagsParser(prog="hpc-launch", add_help=False, allow_abbrev=False)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--help", "-h", action="store_true")
    parser.add_argument("--hydra-help", action="store_true")
    parser.add_argument("--version", action="store_true")
    parser.add_argument("--cfg", "-c", choices=["job", "hydra", "all"])
    parser.add_argument("--resolve", action="store_true")
    parser.add_argument("--package", "-p")
    parser.add_argument("--run", "-r", action="store_true")
    parser.add_argument("--multirun", "-m", action="store_true")
    parser.add_argument("--shell-completion", "-sc", action="store_true")
    parser.add_argument("--config-path", "-cp")
    parser.add_argument("--config-name", "-cn")
    parser.add_argument("--config-dir", "-cd")
    parser.add_argument("--experimental-rerun")
    parser.add_argument("--info", "-i", const="all", nargs="?", choices=show.INFO_SECTIONS)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Hydra's flags: `--config-dir DIR` and `--config-dir=DIR` alike. A script's own options
    before `--` get a line saying where they go."""
    args, unknown = flags_parser().parse_known_args(argv)
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)} (a script's own arguments go after --: hpc-launch script=train.py -- --lr 0.1)")
    if args.shell_completion:
        raise UserError("--shell-completion: hpc-launch has no shell completion (--help lists the config groups and keys)")
    if args.experimental_rerun:
        raise UserError("--experimental-rerun: not supported (it unpickles a file); rerun with the overrides in <run dir>/.hydra/overrides.yaml")
    if args.run and args.multirun:
        raise UserError("--run and --multirun exclude each other")
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
    return bool(args.help or args.hydra_help or args.version or args.cfg or args.info)


def print_info(args: argparse.Namespace) -> None:
    """--version, --help, --hydra-help, --cfg, --info: of the config these overrides compose (with
    -m, of what every point shares)."""
    from hydra.core.hydra_config import HydraConfig

    if args.version:
        print(show.version())
        return
    source = config_source(args)
    overrides = fixed_overrides(args.overrides) if args.multirun else args.overrides
    with initialized(source):
        cfg = compose_run(overrides, source)
        if args.help:
            print(show.app_help(cfg))
        elif args.hydra_help:
            print(show.hydra_help())
        elif args.cfg:
            HydraConfig.instance().set_config(cfg)  # ${hydra:...} in the job's config, for --resolve
            print(show.show_cfg(cfg, args.cfg, args.package, args.resolve))
        else:
            print(show.show_info(cfg, args.info))


@dataclass(frozen=True)
class Sweep:
    """`-m`, checked: every point (a grid's) or every edge of the search space (a search's)
    composed and validated, and the config every point shares (hydra.sweep.dir)."""

    points: list[tuple[list[str], JobConfig]]
    search: Search | None
    shared: DictConfig


def check_sweep(args: argparse.Namespace) -> Sweep:
    """Every check a sweep gets, before its sweep dir is made: a refused command leaves nothing.
    Raises UserError with one line."""
    source = config_source(args)
    shared = multirun_config(fixed_overrides(args.overrides), source)
    sweeper = sweeper_of(shared)
    if sweeper.get("launcher") != ARRAY_LAUNCHER:
        launcher = sweeper.get("launcher")
        raise UserError(f"hydra.launcher._target_={launcher}: hpc-launch submits sweeps itself (job arrays): leave hydra/launcher at hpc_array")
    search = None if is_basic(sweeper) else check_search(args.overrides, sweeper, source)
    points = search.points if search else sweep_points(args.overrides, source, sweeper)
    prepared = []
    for num, (overrides, job) in enumerate(points):
        try:
            prepared.append((overrides, prepare(job)))  # validated once: hpc.launching.sweep submits these
        except UserError as err:
            where = (
                f"the search space at {' '.join(o for o in overrides if o not in args.overrides)}"
                if search
                else f"sweep point #{num} ({' '.join(overrides) or 'no overrides'})"
            )
            raise UserError(f"{where}: {err}") from None
    return Sweep(prepared, search, shared)


def sweep_dir_of(shared: DictConfig) -> Path:
    return Path(str(shared.hydra.sweep.dir)).absolute()


def run_grid(sweep: Sweep) -> None:
    """`-m` with the basic sweeper (a grid), as grid_sweep runs it; exits with its code."""
    code = grid_sweep(sweep)
    sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
    if code:
        sys.exit(code)


def grid_sweep(sweep: Sweep, emit: Callable[[str], None] = print) -> int:
    """`-m` with the basic sweeper (a grid): the sweep dir (hydra.sweep.dir) with its
    multirun.yaml, then every point submitted as job arrays, or run locally one after another
    (hpc.launching.sweep); the worst point's code (0 for submitted arrays)."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict, read_write

    from hpc.launching.sweep import SweepPoint, discard_unsubmitted, launch_sweep

    cfg = sweep.shared
    sweep_dir = sweep_dir_of(cfg)
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.mode = RunMode.MULTIRUN
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, sweep_dir / "multirun.yaml")  # as Hydra's sweepers record a sweep
    nums = list(range(len(sweep.points)))
    if len(nums) == 1:  # what Hydra's -m does with one point, said: a user may have meant a plain job
        print("note: -m with one point is a sweep of one (one array task, a sweep dir); leave out -m for a plain job", file=sys.stderr)
    try:
        code = launch_sweep([SweepPoint(num, tuple(overrides), job, None) for num, (overrides, job) in zip(nums, sweep.points, strict=True)], sweep_dir, emit)
    except (UserError, BrokenPipeError):  # refused, or `hpc-launch -m ... | head -1`
        discard_unsubmitted(sweep_dir, nums)
        raise
    discard_unsubmitted(sweep_dir, nums)  # a dry run: nothing went out
    return code


def run_search(args: argparse.Namespace, sweep: Sweep) -> None:
    """`-m hydra/sweeper=optuna`: the study, its trials composed as Optuna asks for them."""
    from hpc.launching.study import StudyRun, run_study

    assert sweep.search is not None
    source = config_source(args)
    run_study(StudyRun(sweep.search, args.argv, sweep_dir_of(sweep.shared), lambda points: compose_jobs(points, source), program()))


def program() -> list[str]:
    """How this command was started, to print a command that runs it again."""
    started = sys.argv[0]
    return ["python", started] if started.endswith(".py") else [Path(started).name]


def restrict_access(jobs: list[JobConfig]) -> None:
    """Before Hydra creates the run (or sweep) dir: it and all in it get this access only."""
    access = {job.run_access for job in jobs}
    if access - set(RUN_ACCESS):
        raise UserError(f"run_access={min(access - set(RUN_ACCESS))!r} is not one of {', '.join(RUN_ACCESS)}")
    for job in jobs:
        note_run_root(job.run_root)  # the folders a dry run may remove again stop here
    apply_run_access("private" if "private" in access else min(access))  # the strictest asked for


@dataclass(frozen=True)
class Single:
    """One job, composed and checked: its config as Hydra composed it (the run dir's record) and
    the line saying what this machine changed in it (None: nothing)."""

    job: JobConfig
    cfg: DictConfig
    note: str | None


def single_job(args: argparse.Namespace, script_args: list[str] | None) -> Single | None:
    """One job with one Hydra composition (the compose API): the config that is checked is the one
    that runs; the process's umask set for its run_access. None, having done nothing, where the
    config itself asks for a multirun (hydra.mode=MULTIRUN)."""
    from hydra.types import RunMode

    source = config_source(args)
    with initialized(source):
        cfg = compose_run(args.overrides, source)
        if cfg.hydra.mode == RunMode.MULTIRUN:
            return None
        job, note = validated(cfg)
        job = with_script_args(job, script_args)
        restrict_access([job])
    return Single(job, cfg, note)


def run_single(args: argparse.Namespace, script_args: list[str] | None) -> bool:
    """One job run or submitted (single_job); False where the config asks for a multirun."""
    single = single_job(args, script_args)
    if single is None:
        return False
    if single.job.verify.mode is not None:
        sys.exit(run_verifier(single.job, args.overrides, script_args))
    execute(single.job, start_run(single.cfg), single.note)
    return True


def run_verifier(job: JobConfig, overrides: list[str], script_args: list[str] | None) -> int:
    """verify=resume: the job run by the resume verifier (hpc/verify/resume.py) in runs of its
    own, on this machine or, for a queued cluster, as jobs of that cluster."""
    import random

    from hpc.verify.resume import VerifyPlan, child_overrides, verify_paths, verify_resume, with_override

    if not job.checkpoint.enabled:
        raise UserError("verify=resume compares the job's checkpoints: leave out checkpoint.enabled=false")
    verify, builtin, queued = job.verify, job.script is None, traits(job.cluster.launcher).queued
    every = verify.every_steps or job.checkpoint.every_steps or (max(2, (verify.steps or 60) // 6) if builtin else 10)
    children = child_overrides(overrides, verify.steps, every, builtin)
    if queued and verify.kill and job.cluster.allocation_restarts == 0 and job.cluster.failure_requeues == 0:
        children = with_override(children, "cluster.failure_requeues", 1)  # the kill must be followed by a requeue to compare anything
    where = f" as jobs of {job.cluster.name} (each requeue waits for the scheduler's hold and queue)" if queued else ""
    if job.dry_run:  # what it would run, nothing more
        passed = " ".join(o for o in children if override_key(o) != "dry_run")
        kill = " and killed once after a periodic save" if verify.kill else ""
        print(f"verify: would run `hpc-launch {passed}`{where} uninterrupted, then stopped {verify.stops} times at random steps{kill}, and compare")
        return 0
    seed = verify.seed if verify.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"verify: seed {seed} (verify.seed={seed} repeats where the stops land), a save every {every} steps{where}", flush=True)
    plan = VerifyPlan(children, script_args, verify.stops, verify.kill, seed, verify_paths(job.run_root), job.cluster.launcher if queued else None)
    return verify_resume(plan, not builtin)


def start_run(cfg: DictConfig) -> RunDir:
    """What Hydra's own run does before the task, through public APIs: the run dir and its
    record (make_run_dir), hydra.job.env_set, and the job's logging (hydra.job_logging: the
    console and <run dir>/launch.log)."""
    import logging.config

    from omegaconf import OmegaConf

    run_dir = make_run_dir(cfg)
    os.environ.update(job_environment(cfg))
    logging.config.dictConfig(OmegaConf.to_container(cfg.hydra.job_logging, resolve=True))  # type: ignore[arg-type]
    return run_dir


def job_environment(cfg: DictConfig) -> dict[str, str]:
    """hydra.job.env_set: variables the job sets in the launching process, for its ranks."""
    return {str(key): str(value) for key, value in cfg.hydra.job.env_set.items()}


def make_run_dir(cfg: DictConfig) -> RunDir:
    """The run dir (hydra.run.dir), its record in <run dir>/.hydra (config.yaml, hydra.yaml,
    overrides.yaml), and HydraConfig for `${hydra:...}` in the job's config."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict, read_write

    path = Path(str(cfg.hydra.run.dir)).absolute()
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(path)
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
    HydraConfig.instance().set_config(cfg)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file on the way, a read-only place: one line, as for any bad input
        raise UserError(f"the run directory {path} cannot be created: {err.strerror} (choose another run_root=)") from None
    if cfg.hydra.output_subdir is not None:
        record = path / str(cfg.hydra.output_subdir)
        record.mkdir(exist_ok=True)
        task = OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])
        OmegaConf.save(task, record / "config.yaml")
        OmegaConf.save(OmegaConf.create({"hydra": cfg.hydra}), record / "hydra.yaml")
        OmegaConf.save(cfg.hydra.overrides.task, record / "overrides.yaml")
    return RunDir(path)


def validated(cfg: DictConfig) -> tuple[JobConfig, str | None]:
    """The job in the composed config (typed already: the defaults list starts with its
    schema) as it runs here, checked and its inputs pinned (hpc.launching.launch.prepare); and the line saying what this machine's GPUs changed
    (hpc.config.local_gpus; None: nothing)."""
    from omegaconf import open_dict

    task = cfg.copy()  # shallow: the hydra node stays in cfg
    with open_dict(task):
        del task["hydra"]
        job, note = local_job(task, [str(o) for o in cfg.hydra.overrides.task])
    return prepare(job), note  # validated once: hpc.launching.launch.launch takes it as it is


def print_search(search: Search, job: JobConfig, command: list[str]) -> None:
    """`-m ... dry_run=true` with a searching sweeper: what each trial would run, nothing more."""
    direction = f" ({search.direction})" if search.direction else ""
    print(f"# hydra/sweeper={search.sweeper}: each trial returns sweep.objective={search.objective}{direction}")
    print(f"# the search space's edges, each composed and checked: {len(search.points)}")
    for overrides, _ in search.points:
        print(f"#   {' '.join(o for o in overrides if o not in command)}")
    where = f"as one job array per batch on {job.cluster.name}" if traits(job.cluster.launcher).queued else "on local MPI ranks, one after another"
    print(f"dry run: nothing submitted; trials would run {where}")


def main(argv: list[str]) -> None:
    """hpc-launch ARGV: print (--help, --cfg ...), run one job, or sweep (-m)."""
    register_schemas()
    load_plugins()
    argv, script_args = split_passthrough(argv)
    args = parse_args(argv)
    args.argv = argv
    if script_args is not None and (args.multirun or info_only(args)):
        raise UserError("arguments after -- go to a single run's script: with -m (or --cfg, --help) give the script's settings as script_args=[...]")
    if info_only(args):
        print_info(args)
        return
    if args.multirun and "verify" in map(override_key, args.overrides):
        raise UserError("verify=resume checks one job: leave out -m (verify each sweep point on its own)")
    if not args.multirun and run_single(args, script_args):
        return
    sweep = check_sweep(args)  # -m, or the config asks for it (hydra.mode=MULTIRUN)
    restrict_access([job for _, job in sweep.points])
    if sweep.search is None:
        run_grid(sweep)
    elif sweep.points[0][1].dry_run:
        print_search(sweep.search, sweep.points[0][1], args.overrides)
    else:
        run_search(args, sweep)


def cli() -> None:
    try:
        main(sys.argv[1:])
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
    except UserError as err:
        fail(str(err), err.exit_code)
    except BrokenPipeError:  # `hpc-launch --cfg job | head -1`
        end_on_closed_stdout()
