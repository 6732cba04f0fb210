"""Submitting from Python (a script, a notebook): `from hpc import submit`.

    from hpc import submit

    job = submit("cluster=simulated", "trainer.max_steps=100")
    job.wait()                  # "COMPLETED"
    job.result()["val_metrics"]

`submit` takes exactly what launch.py takes (overrides, Hydra's flags, `-m` for a sweep, and a
script's own arguments as `script_args`) and runs launch.py, so a job submitted from Python is
checked, composed, frozen and submitted as one from the command line is, with the same one-line
errors (raised as SubmitError). It returns a `Job` (a sweep: a list, one per point): its Slurm
job id, its run dir, and `state()`, `wait()`, `result()`, `cancel()`. With cluster=local the
ranks run before `submit` returns, as launch.py runs them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.rundir import PROJECT_ROOT, RunDir
from hpc.submit.launchers import GONE, LAUNCHERS, QueuedLauncher, queued_launcher

LAUNCH = PROJECT_ROOT / "launch.py"
RESULT_STATES = {"completed": "COMPLETED", "failed": "FAILED", "stopped": "STOPPED"}


class SubmitError(UserError):
    """launch.py refused or failed; the message is its error line."""


@dataclass(frozen=True)
class Job:
    """A submitted job (or a local run that has ended), known by its run dir."""

    run_dir: Path
    job_id: str | None  # None: a local run

    def state(self) -> str:
        """Slurm's state while Slurm knows the job; then (and for a local run) the run dir's:
        COMPLETED, FAILED, STOPPED (resumable), or UNKNOWN before a rank wrote its result."""
        if self.job_id is not None:
            state = self.launcher().jobs([self.job_id])[self.job_id].state
            if state != GONE:
                return state
        status = self.result().get("status")
        return RESULT_STATES.get(str(status), "UNKNOWN")

    def wait(self, timeout_s: float | None = None, poll_s: float = 2.0) -> str:
        """Block until the job ended (for a requeued job: until it ended for good); its state.
        TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.state()
            if self.job_id is None or state in self.launcher().terminal_states:
                return state
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still {state} after {timeout_s:g} s")
            time.sleep(poll_s)  # squeue offers no event for a job's end

    def result(self) -> dict[str, Any]:
        """result.json: how the run ended, its steps and figures ({} before a rank wrote it)."""
        try:
            loaded = json.loads(RunDir(self.run_dir).result.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def cancel(self) -> None:
        """Cancel the queued job (a requeued job too); a local run has ended already."""
        if self.job_id is not None:
            failed = self.launcher().cancel(self.job_id)
            if failed:
                raise SubmitError(f"cancelling job {self.job_id}: {failed}")

    def launcher(self) -> QueuedLauncher:
        """Whom to ask of the job: the launcher its job.json names (Slurm before it named one)."""
        try:
            named = RunDir(self.run_dir).read_json(RunDir(self.run_dir).job).get("launcher")
        except (OSError, ValueError, AttributeError):
            named = None
        return queued_launcher(named if isinstance(named, str) and named in LAUNCHERS else "slurm")


def submit(*overrides: str, script_args: Sequence[str] = (), cwd: str | Path | None = None, python: str = sys.executable) -> Job | list[Job]:
    """Run launch.py with `overrides` (and `-- script_args`) in `cwd`; the job, or a sweep's jobs.
    SubmitError with launch.py's error line when it refuses or fails."""
    command = [python, str(LAUNCH), *map(str, overrides), *(["--", *map(str, script_args)] if script_args else [])]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        raise SubmitError(errors[-1].removeprefix("error: ") if errors else f"launch.py exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return jobs_of(done.stdout, Path(cwd) if cwd is not None else Path.cwd())


def jobs_of(printed: str, cwd: Path) -> Job | list[Job]:
    """The jobs launch.py's output names: a sweep dir's points (sweep.json), or one run dir."""
    sweep = re.search(r"^sweep directory: (.+)$", printed, re.MULTILINE)
    if sweep is not None:
        record = json.loads((cwd / sweep.group(1)).joinpath("sweep.json").read_text())
        return [Job(cwd / point["run_dir"], point.get("job_id")) for point in record.get("points", [])]
    run = re.search(r"^run directory: (.+)$", printed, re.MULTILINE)
    if run is None:
        raise SubmitError(f"launch.py named no run directory (dry_run=true submits nothing): {printed.strip()[-300:]}")
    submitted = re.search(r"^submitted job (\d+(?:_\d+)?)", printed, re.MULTILINE)
    return Job(cwd / run.group(1), submitted.group(1) if submitted else None)
