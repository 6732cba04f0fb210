"""The launcher seam: how a job's ranks start, behind one of two interfaces.

- A foreground launcher runs the ranks now, on this machine, and returns their exit code
  (LocalLauncher: mpirun). A sweep's points on it run one after another.
- A queued launcher hands jobs to a scheduler and answers for them later: one job, or one job
  array for several run dirs, then their states, cancel and wait (SlurmLauncher: sbatch through
  submitit).

launch.py's job, a sweep's points, a study's trials, hpc.resubmit and the Python API reach the
launchers only through `launcher_for(job)` and these two classes; what the login-node checks
need to know of a launcher is in hpc.config.launchers (its traits). A new scheduler is a plugin
(hpc.schedulers): a subclass of QueuedLauncher, its traits, its rank environment and its
ranks' side behind hpc.rank.scheduler.Scheduler, in a package of its own (Slurm's: hpc.slurm).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc.config.launchers import LauncherTraits, traits
from hpc.config.schema import JobConfig
from hpc.errors import UserError
from hpc.launching import local
from hpc.rundir import RunDir
from hpc.schedulers import SchedulerPluginError, loaded, plugins

GONE = "GONE"  # a job's state once its scheduler no longer knows it


@dataclass(frozen=True)
class QueuedJob:
    """A queued job as its scheduler shows it now."""

    state: str  # the scheduler's own word (RUNNING, PENDING, COMPLETED, ...), or GONE
    restarts: int = 0  # how often it was requeued
    reason: str = ""  # why it waits, in the scheduler's words ("Dependency", "requeue hold to 06:01:10")


class ForegroundLauncher(ABC):
    traits: LauncherTraits

    @abstractmethod
    def dry_run(self, job: JobConfig, env: dict[str, str], run_dir: RunDir) -> str:
        """What running the job would run, as text; runs nothing."""

    @abstractmethod
    def run(
        self, job: JobConfig, env: dict[str, str], run_dir: RunDir, info: dict[str, Any] | None = None, code: Path | None = None, stops: list[int] | None = None
    ) -> int:
        """Run the job's ranks to their end, here; their exit code. `info`: more for job.json;
        `code`: sources frozen already; `stops`: each signal that reached this process meanwhile."""

    @abstractmethod
    def start(self, job: JobConfig, env: dict[str, str], run_dir: RunDir, console: Path) -> subprocess.Popen[bytes]:
        """Start the job's ranks in the background (the Python API); rank 0's console into
        `console`; SIGINT or SIGTERM to the process stops them at a step, with a save."""


class QueuedLauncher(ABC):
    traits: LauncherTraits
    terminal_states: frozenset[str]  # a job in one of these has ended for good (unless requeued)
    waiting_states: frozenset[str]  # queued, held or suspended: not started, or not running now
    running_states: frozenset[str]  # its ranks run, or are ending
    succeeded_states: frozenset[str]  # ended having done its work (launch.py's wait=true exits 0 on these)

    @abstractmethod
    def dry_run(self, job: JobConfig, env: dict[str, str], run_dir: RunDir) -> str:
        """The script the job would be submitted as; submits nothing."""

    @abstractmethod
    def submit(self, job: JobConfig, env: dict[str, str], run_dir: RunDir, code: Path) -> str:
        """Submit the job (its ranks run `code`, frozen); its job id."""

    @abstractmethod
    def array_parameters(self, job: JobConfig, env: dict[str, str], code: Path) -> dict[str, Any]:
        """What the scheduler is asked for: jobs with equal parameters share one array."""

    @abstractmethod
    def max_array_size(self) -> int | None:
        """The most tasks one array may have here; None: no limit known."""

    @abstractmethod
    def after_any(self, params: dict[str, Any], job_id: str) -> dict[str, Any]:
        """`params` of a job held until `job_id` ended, whichever way."""

    @abstractmethod
    def submit_array(self, params: dict[str, Any], run_dirs: list[RunDir], folder: Path, max_parallel: int | None) -> tuple[str, list[str], str]:
        """One submission for all `run_dirs`, at most `max_parallel` running at once: the
        array's job id, each run dir's own, and the submitted script."""

    @abstractmethod
    def render_array(self, params: dict[str, Any], folder: Path, run_dirs: list[RunDir], max_parallel: int) -> str:
        """The script submit_array would submit; submits nothing."""

    @abstractmethod
    def jobs(self, job_ids: list[str]) -> dict[str, QueuedJob]:
        """Each job as the scheduler (or its accounting, for ended ones) shows it; GONE where neither knows it."""

    @abstractmethod
    def cancel(self, job_id: str) -> str | None:
        """Cancel the job (a requeued one too); the error text, None on success."""

    @abstractmethod
    def signal(self, job_id: str, name: str) -> str | None:
        """Send signal `name` (USR1, KILL, ...) to the ranks of the running job, not to what
        requeues it (KILL: the ranks die at once, as on a lost node; the job goes on); the error
        text, None on success."""

    @abstractmethod
    def wait(self, job_id: str, run_dir: RunDir, emit: Callable[[str], None] = print, emit_err: Callable[[str], None] = print) -> str:
        """Block until the job ended, printing rank 0's stdout (`emit`) and stderr (`emit_err`)
        as they grow, as a local run shows them; its final state."""

    def console(self, job_id: str, run_dir: RunDir) -> Path | None:
        """The file rank 0's console (its stdout) goes to, where the scheduler keeps one."""
        return None

    def query_tool(self) -> str:
        """The command this machine needs to ask the scheduler of its jobs (hpc.stop, after=)."""
        return self.traits.tool

    def stoppable(self, state: str) -> bool:
        """Whether a job in `state` has ranks a stop signal reaches (hpc.stop)."""
        return state in self.running_states

    def check(self, job: JobConfig) -> None:
        """The job's settings only this scheduler knows (Slurm's: cluster.sbatch), checked on
        the login node before anything is written, dry runs included; UserError in one line."""
        return None

    def refusal(self, job: JobConfig) -> str | None:
        """What the scheduler itself cannot run of the checked job (asked of its tools before a
        submission: a plugin the job needs); None: nothing."""
        return None

    def dependency_state(self, job_id: str) -> str | None:
        """A job's state as a job waiting on it (after=, after_any=) sees it; None: unknown to
        the scheduler, so nothing could wait on it."""
        state = self.jobs([job_id])[job_id].state
        return None if state == GONE else state

    def signal_command(self, job_id: str, name: str) -> str:
        """What `signal(job_id, name)` runs, in the scheduler's words, for the line that says so."""
        return f"{self.traits.scheduler}: signal {name} to job {job_id}"

    def cancel_hint(self, job_id: str) -> str:
        """How a user cancels the job, for a hint."""
        return f"{self.traits.scheduler}'s own cancel removes it"


Launcher = ForegroundLauncher | QueuedLauncher


class LocalLauncher(ForegroundLauncher):
    traits = traits("local")

    def dry_run(self, job: JobConfig, env: dict[str, str], run_dir: RunDir) -> str:
        command = local.pinned_command(local.rank_command(job, run_dir), env, run_dir.code, os.environ.get("PYTHONPATH"))
        return f"# command (cluster={job.cluster.name} runs mpirun, no sbatch)\n{shlex.join(command)}"

    def run(
        self, job: JobConfig, env: dict[str, str], run_dir: RunDir, info: dict[str, Any] | None = None, code: Path | None = None, stops: list[int] | None = None
    ) -> int:
        return local.run_local(job, env, run_dir, info, code, stops)

    def start(self, job: JobConfig, env: dict[str, str], run_dir: RunDir, console: Path) -> subprocess.Popen[bytes]:
        return local.start_local(job, env, run_dir, console)


_LAUNCHERS: dict[str, Launcher] = {}


def launchers() -> dict[str, Launcher]:
    """Every launcher by name (cluster.launcher): this machine's, then each scheduler plugin's
    (hpc.schedulers), made once per process."""
    if not _LAUNCHERS:
        _LAUNCHERS["local"] = LocalLauncher()
        for name in plugins():
            made = loaded(name, "launcher")()
            if not isinstance(made, QueuedLauncher) or made.traits.name != name:
                raise SchedulerPluginError(f"scheduler plugin {name!r}: its launcher is not a QueuedLauncher with the traits named {name!r}")
            _LAUNCHERS[name] = made
    return _LAUNCHERS


def launcher_for(job: JobConfig) -> Launcher:
    """The job's launcher (cluster.launcher, checked by hpc.config.validate)."""
    return launchers()[job.cluster.launcher]


def queued_launchers() -> list[QueuedLauncher]:
    return [launcher for launcher in launchers().values() if isinstance(launcher, QueuedLauncher)]


# job.json's names of launchers from before they were the launchers' own: a hand-typed sbatch
# script's job (hpc.slurm.prepare) wrote "sbatch" until 2026-12-03
FORMER_NAMES = {"sbatch": "slurm"}


def job_launcher(job: dict[str, Any]) -> QueuedLauncher:
    """The queued launcher a job.json names (Slurm where it names none: written before launchers
    were named); UserError for a name this toolkit does not know."""
    name = job.get("launcher") or "slurm"
    name = FORMER_NAMES.get(str(name), name)
    if name not in launchers():
        raise UserError(f"job.json names launcher {name!r}, which this toolkit does not know (known: {', '.join(launchers())})")
    return queued_launcher(str(name))


def queued_launcher(name: str) -> QueuedLauncher:
    """The queued launcher of that name (a job.json's `launcher`)."""
    chosen = launchers()[name]
    if not isinstance(chosen, QueuedLauncher):
        raise ValueError(f"launcher {name} runs jobs in the foreground; it queues none")
    return chosen
