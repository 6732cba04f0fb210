"""Submitting from Python (a script, a notebook): `from hpc import submit`.

    from hpc import submit

    job = submit("cluster=simulated", "trainer.max_steps=100")
    for line in job.lines():    # rank 0's console as it grows, until the job ends
        print(line)
    job.wait()                  # "COMPLETED"
    job.result()["val_metrics"]

`submit` takes what launch.py takes (overrides, Hydra's flags, `-m` for a grid sweep, and a
script's own arguments as `script_args`) and does what launch.py does, in this process: the job is
composed, checked, frozen and submitted with the same one-line errors (raised as SubmitError).
It returns a `Job` at once, for a queued cluster and for local ranks alike: local ranks run in
the background (rank 0's console in <run dir>/console.log). A grid sweep returns its jobs, one
per point: submitted as job arrays at once; on local ranks its points run one after another
before `submit` returns, as launch.py -m runs them. What this process was (its umask, working
directory, environment and logging) is as it was when `submit` returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc.app import Single, check_sweep, discard, grid_sweep, info_only, job_environment, make_run_dir, parse_args, restrict_access, single_job, sweep_dir_of
from hpc.config.compose import load_plugins, register_schemas
from hpc.config.launchers import traits
from hpc.config.local_gpus import override_key
from hpc.errors import UserError
from hpc.launching.deaths import KILLED, tell_killed
from hpc.launching.follow import Follower
from hpc.launching.launch import rank_environment, record_run, submit_job
from hpc.launching.launchers import GONE, ForegroundLauncher, QueuedLauncher, job_launcher, launcher_for
from hpc.launching.sweep import SWEEP_FILE
from hpc.rundir import RunDir

RESULT_STATES = {"completed": "COMPLETED", "failed": "FAILED", "stopped": "STOPPED"}
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # hydra.job_logging's file handler


class SubmitError(UserError):
    """The job was refused or could not be submitted; the message is launch.py's error line."""


@dataclass(frozen=True)
class Job:
    """A submitted job or a run of local ranks, known by its run dir; `process`: the local
    ranks this process started (None: a queued job, or local ranks another process ran), and
    `recorded`: set once they exited and their end is recorded (after_ranks)."""

    run_dir: Path
    job_id: str | None
    process: subprocess.Popen[bytes] | None = field(default=None, compare=False, repr=False)
    recorded: threading.Event | None = field(default=None, compare=False, repr=False)

    def state(self) -> str:
        """RUNNING while local ranks run; the scheduler's state while it knows the job; then the
        run dir's: COMPLETED, FAILED, STOPPED (resumable), or UNKNOWN (it ended without a word)."""
        if self.recorded is not None and not self.recorded.is_set():
            return "RUNNING"
        if self.job_id is not None:
            state = self.launcher().jobs([self.job_id])[self.job_id].state
            if state != GONE:
                return state
        status = RESULT_STATES.get(str(self.result().get("status")), "UNKNOWN")
        return "FAILED" if status == "UNKNOWN" and self.process is not None and self.process.returncode else status

    def ended(self, forgotten_polls: int = 1) -> bool:
        """Whether the job is over: its ranks exited (their end recorded), or its scheduler calls
        it ended, or forgot it (a requeued job has not ended)."""
        return self.over(forgotten_polls)[0]

    def over(self, forgotten_polls: int) -> tuple[bool, int]:
        """(ended, how many polls in a row the scheduler knew no such job); a job it forgot has
        ended once it says so twice (one slow scontrol reads the same) or the run dir has its end."""
        if self.job_id is None:
            return self.recorded is None or self.recorded.is_set(), 0
        launcher = self.launcher()
        state = launcher.jobs([self.job_id])[self.job_id].state
        forgotten = forgotten_polls + 1 if state == GONE else 0
        return state in launcher.terminal_states or forgotten >= 2 or (forgotten == 1 and bool(self.result())), forgotten

    def wait(self, timeout_s: float | None = None, poll_s: float = 2.0) -> str:
        """Block until the job ended (for a requeued job: until it ended for good); its state.
        TimeoutError after `timeout_s`."""
        if self.recorded is not None:
            if not self.recorded.wait(timeout_s):
                raise TimeoutError(f"the ranks of {self.run_dir} still run after {timeout_s:g} s")
            return self.state()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        ended, forgotten = self.over(0)
        while not ended:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {self.state()} after {timeout_s:g} s")
            time.sleep(poll_s)  # a scheduler's queue offers no event for a job's end
            ended, forgotten = self.over(forgotten)
        return self.state()

    def result(self) -> dict[str, Any]:
        """result.json: how the run ended, its steps and figures ({} before a rank wrote it)."""
        return RunDir(self.run_dir).read_result()

    def console(self) -> Path | None:
        """The file rank 0's console goes to (local ranks: stdout and stderr; a queued job: its
        stdout, the file its scheduler keeps); None: the scheduler keeps none, or local ranks
        another process ran, whose console was its terminal."""
        if self.job_id is None:
            return RunDir(self.run_dir).console if self.process is not None else None
        return self.launcher().console(self.job_id, RunDir(self.run_dir))

    def logs(self) -> str:
        """Rank 0's console so far ("" before it wrote anything)."""
        lines: list[str] = []
        path = self.console()
        if path is not None:
            Follower(path, lines.append)(flush=True)
        return "\n".join(lines)

    def lines(self, poll_s: float = 0.5) -> Iterator[str]:
        """Rank 0's console line by line as it grows, from its start until the job ended."""
        lines: list[str] = []
        path = self.console()
        if path is None:
            return
        follow, forgotten = Follower(path, lines.append), 0
        while True:
            ended, forgotten = self.over(forgotten)
            follow(flush=ended)
            yield from lines
            lines.clear()
            if ended:
                return
            time.sleep(poll_s)  # a file that grows offers no event here

    def cancel(self) -> None:
        """Local ranks: stopped at a step with a save, as a Ctrl-C stops them (resumable:
        `bash <run dir>/command.txt`); a queued job: cancelled."""
        if self.process is not None:
            if self.recorded is None or not self.recorded.is_set():  # never a reaped pid: another process may have it now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGTERM)
        elif self.job_id is not None and (failed := self.launcher().cancel(self.job_id)):
            raise SubmitError(f"cancelling job {self.job_id}: {failed}")

    def launcher(self) -> QueuedLauncher:
        """Whom to ask of the job: the launcher its job.json names (Slurm before it named one)."""
        try:
            record = RunDir(self.run_dir).read_json(RunDir(self.run_dir).job)
        except (OSError, ValueError):
            record = {}
        return job_launcher(record if isinstance(record, dict) else {})


def submit(*overrides: str, script_args: Sequence[str] | None = None, cwd: str | Path | None = None) -> Job | list[Job]:
    """Compose, check and submit the job of `overrides` (a script's arguments: `script_args`),
    with relative paths taken from `cwd`; the job, or a grid sweep's jobs. SubmitError with
    the line launch.py would print when it is refused."""
    argv = [str(override) for override in overrides]
    passed = None if script_args is None else [str(arg) for arg in script_args]
    with kept_process_state(cwd):
        try:
            return submitted(argv, passed)
        except UserError as err:
            raise SubmitError(str(err)) from None


def submitted(argv: list[str], script_args: list[str] | None) -> Job | list[Job]:
    register_schemas()
    load_plugins()
    args = parse_args(argv)
    args.argv = argv
    if info_only(args):
        raise UserError("--help, --cfg, --info and --version print and submit nothing: run them as hpc-launch")
    if "verify" in map(override_key, args.overrides):
        raise UserError("verify=resume runs the verifier in the foreground: run it as hpc-launch verify=resume ...")
    if script_args is not None and args.multirun:
        raise UserError("script_args go to a single run's script: with -m give them as script_args=[...] among the overrides")
    single = None if args.multirun else single_job(args, script_args)
    if single is not None:
        return start(single)
    sweep = check_sweep(args)
    if sweep.search is not None:
        raise UserError("a search (hydra/sweeper=optuna) runs its trials from the command line: hpc-launch -m ...")
    if sweep.points[0][1].dry_run:
        raise UserError("dry_run=true submits nothing: run it as hpc-launch to see what would run")
    if any(not traits(job.cluster.launcher).queued for _, job in sweep.points) and threading.current_thread() is not threading.main_thread():
        raise UserError("a sweep of local runs runs its points here, one after another, passing Ctrl-C on: call submit from the main thread")
    restrict_access([job for _, job in sweep.points])
    grid_sweep(sweep, emit=lambda line: None)
    sweep_dir = sweep_dir_of(sweep.shared)
    points = RunDir(sweep_dir).read_json(sweep_dir / SWEEP_FILE).get("points", [])
    return [Job(sweep_dir / point["run_dir"], point.get("job_id")) for point in points]


def start(single: Single) -> Job:
    """The run dir made and the job submitted, or its local ranks started in the background."""
    job = single.job
    if job.dry_run:
        raise UserError("dry_run=true submits nothing: run it as hpc-launch to see what would run")
    if job.verify.mode is not None:
        raise UserError("verify=resume runs the verifier in the foreground: run it as hpc-launch verify=resume ...")
    run_dir = make_run_dir(single.cfg)
    os.environ.update(job_environment(single.cfg))  # for the ranks, as launch.py sets them; undone after
    with launch_log(run_dir) as log:
        if single.note:
            log(single.note)
        try:
            record_run(job, run_dir)
            launcher, env = launcher_for(job), rank_environment(job)
            if isinstance(launcher, QueuedLauncher):
                job_id = submit_job(launcher, job, env, run_dir)
                log(f"submitted job {job_id} to {job.cluster.name} (a job to run once it completes: after={job_id})")
                return Job(run_dir.path, job_id)
            assert isinstance(launcher, ForegroundLauncher)
            process = launcher.start(job, env, run_dir, run_dir.console)
            log(f"ranks started in the background (pid {process.pid}); their console: {run_dir.console}")
        except UserError:
            discard(run_dir)
            raise
    recorded = threading.Event()
    threading.Thread(target=after_ranks, args=(process, run_dir, recorded), daemon=True, name="hpc-ranks-end").start()
    return Job(run_dir.path, None, process, recorded)


def after_ranks(process: subprocess.Popen[bytes], run_dir: RunDir, recorded: threading.Event) -> None:
    """The one waiter of the background ranks (the process reaped: no zombie for hpc.status to
    take for running): once they exit, their end in launch.log, and for ranks the kernel killed,
    the end only the launcher can record (hpc.launching.deaths); then `recorded` is set."""
    try:
        code = process.wait()
        with launch_log(run_dir) as log:
            log(f"the ranks exited with code {code}; command: {run_dir.path / 'command.txt'}")
            if code == KILLED:
                log(tell_killed(run_dir))
    finally:
        recorded.set()


@contextlib.contextmanager
def launch_log(run_dir: RunDir) -> Iterator[Callable[[str], None]]:
    """A writer of lines into <run dir>/launch.log, as launch.py's logging writes them (this
    process's own logging untouched)."""
    handler = logging.FileHandler(run_dir.path / "launch.log")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))

    def log(line: str) -> None:
        handler.handle(logging.LogRecord("hpc.launch", logging.INFO, __file__, 0, line, None, None))

    try:
        yield log
    finally:
        handler.close()


@contextlib.contextmanager
def kept_process_state(cwd: str | Path | None) -> Iterator[None]:
    """What launching changes in its process put back when the launch is done: the umask for
    run_access, the working directory relative paths are taken from, hydra.job.env_set, and
    Hydra's global state (a caller inside its own Hydra app keeps it). Not for two threads at once."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    umask = os.umask(0o077)
    os.umask(umask)
    environ, here = dict(os.environ), os.getcwd()
    hydra = GlobalHydra.instance()
    callers_hydra, callers_config = (hydra.hydra if hydra.is_initialized() else None), HydraConfig.instance().cfg
    hydra.clear()
    try:
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(here)
        os.umask(umask)
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update({name: value for name, value in environ.items() if os.environ.get(name) != value})
        hydra = GlobalHydra.instance()  # Hydra's own contexts put back a copy of the one they found
        hydra.clear()
        if callers_hydra is not None:
            hydra.initialize(callers_hydra)
        HydraConfig.instance().cfg = callers_config


__all__ = ["Job", "SubmitError", "submit"]
