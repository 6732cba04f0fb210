"""The resume verifier's runs, started, stopped, killed and resumed as the job's cluster does it.

- LocalRuns (cluster=local): the ranks are processes on this machine. The stop signal and
  SIGKILL go to their pids (hpc.rankprocs); a stopped or killed start ends, and `bash
  RUN_DIR/command.txt` resumes it, as a requeue would.
- QueuedRuns (a scheduler: cluster=<a Slurm cluster>): each run is one job, submitted with
  wait=true (its launch ends when the job does). The stop signal and SIGKILL go to the job's
  ranks through the scheduler (hpc.launching.launchers: `scancel --signal`), and the job goes on by
  itself: requeued by its batch script after a stop, restarted in its allocation (or requeued)
  after a kill. What happened is read from the run's timeline (hpc.rank.timeline): rank 0's
  `stop` events, and its `start` events with the step each start resumed from.

Login-node code: no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from hpc.errors import UserError
from hpc.interruptions import TIMELINE
from hpc.proctree import kill_tree
from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.rankprocs import live_ranks, stop_signal
from hpc.rundir import RunDir, last_record, read_jsonl

POLL_S = 0.01
QUEUE_POLL_S = 1.0  # a queued job's state is asked of its scheduler: not a hundred times a second
RUN_TIMEOUT_S = 3600.0  # a local run; a queued one waits as long as its queue makes it
# The launch command in a child process, as `hpc-launch` (the verifier's own option left out)
LAUNCH = "import sys; sys.argv[0] = 'hpc-launch'; from hpc.app import cli; cli()"


class VerifyFailure(Exception):
    """A run of the verifier did not end as it must; the message says how."""


class Launch:
    """One start of a run: the launch command or a resume, its output kept in a log file, in a
    session of its own (a Ctrl-C reaches the verifier, which stops its runs: `stop_all`)."""

    live: set[Launch] = set()

    def __init__(self, command: list[str], log: Path, timeout_s: float | None = RUN_TIMEOUT_S) -> None:
        self.log, self.timeout_s = log, timeout_s
        with log.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        Launch.live.add(self)

    @classmethod
    def stop_all(cls, grace_s: float = 60.0) -> None:
        """Every run still going: Ctrl-C's stop (each stops at a step and saves), then SIGKILL
        after `grace_s`."""
        running = [launch for launch in cls.live if launch.proc.poll() is None]
        for launch in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launch.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for launch in running:
            try:
                launch.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(launch.proc.pid)  # mpirun and its ranks too: a session of their own, each rank a group
                launch.proc.wait()
        cls.live.clear()

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            raise UserError(f"verify: a run took over {self.timeout_s:.0f} s; its output: {self.log}") from None

    def tail(self) -> str:
        return self.tail_of(self.log)

    @staticmethod
    def tail_of(log: Path, lines: int = 3) -> str:
        """The last lines of a run's output, on one line."""
        text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
        return " | ".join(line.strip() for line in text[-lines:]) or f"(no output; see {log})"


def launcher() -> list[str]:
    """This command, started again: `python launch.py` from a checkout (its folder first on the
    import path, as for the verifier itself), else the installed `hpc-launch`'s code."""
    started = sys.argv[0]
    return [sys.executable, os.path.abspath(started)] if started.endswith(".py") else [sys.executable, "-c", LAUNCH]


def launch_command(overrides: Sequence[str], script_args: list[str] | None, run_dir: Path) -> list[str]:
    args = [*overrides, f"hydra.run.dir={run_dir}"]
    if script_args is not None:
        args += ["--", *script_args]
    return [*launcher(), *args]


def wait_until(ready: Callable[[], bool], launch: Launch, poll_s: float = POLL_S) -> bool:
    """Poll until `ready()`; False once the run ended first."""
    while not ready():
        if launch.ended():
            return ready()
        time.sleep(poll_s)
    return True


def logged_step(run_dir: Path) -> int:
    record = last_record(RunDir(run_dir).steps)
    return int(record["step"]) if record else 0


def committed(run_dir: Path) -> list[int]:
    from trainers.checkpoint.storage import stored_checkpoints

    try:
        return stored_checkpoints(run_dir / "checkpoints").committed_steps()
    except OSError:
        return []


def events(run_dir: Path, kind: str) -> list[dict[str, object]]:
    """Rank 0's timeline events of `kind` (stop, start), oldest first."""
    return [event for event in read_jsonl(run_dir / TIMELINE) if event.get("event") == kind]


class Runs(Protocol):
    """How the verifier's runs start, are signalled, and go on after a stop or a kill."""

    def start(self, overrides: Sequence[str], script_args: list[str] | None, run_dir: Path) -> Launch:
        """Start the run into `run_dir`."""

    def signal(self, run_dir: Path, name: str) -> bool:
        """`name` (stop: the run's stop signal, as hpc.stop sends it; KILL) to every rank of the
        run; False when none runs (yet, or any more)."""

    def went_on(self, run_dir: Path, launch: Launch, after: str, seen: int) -> tuple[Launch, int] | None:
        """After the stop (`after`="stop") or the kill ("kill") was sent, with `seen` timeline
        events of its kind then: the start that goes on and the step it resumed from; None when
        the run completed first."""

    def abandon(self) -> None:
        """A Ctrl-C: every run still going stopped (or cancelled)."""


def signal_name(run_dir: Path, name: str) -> str:
    """`stop`: the run's own stop signal (cluster.signal), as hpc.stop sends it; else `name`."""
    return stop_signal(RunDir(run_dir)) if name == "stop" else name


def seen_events(run_dir: Path, after: str) -> int:
    """The timeline events that tell a stop (`stop`) or a kill (the next `start`) took effect."""
    return len(events(run_dir, "stop" if after == "stop" else "start"))


class LocalRuns:
    """A local job's runs: ranks signalled by pid; each stopped or killed start ends, and `bash
    RUN_DIR/command.txt` resumes it."""

    def start(self, overrides: Sequence[str], script_args: list[str] | None, run_dir: Path) -> Launch:
        return Launch(launch_command(overrides, script_args, run_dir), run_dir.with_suffix(".log"))

    def signal(self, run_dir: Path, name: str) -> bool:
        run = RunDir(run_dir)
        try:
            ranks = live_ranks(run, socket.gethostname())
        except UserError:
            return False
        sig = signal.Signals[f"SIG{signal_name(run_dir, name)}"]
        for beat in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(beat.pid, sig)
        return True

    def went_on(self, run_dir: Path, launch: Launch, after: str, seen: int) -> tuple[Launch, int] | None:
        code = launch.wait()
        if code == 0:
            return None
        if after == "stop" and code != EXIT_RESUMABLE:
            raise VerifyFailure(f"the stopped run ended with code {code}, not {EXIT_RESUMABLE} (resumable): {launch.tail()}")
        resumed = max(committed(run_dir), default=0)
        return Launch(["bash", str(run_dir / "command.txt")], launch.log), resumed

    def abandon(self) -> None:
        Launch.stop_all()


class QueuedRuns:
    """A queued job's runs: one job each, submitted with wait=true, signalled through its
    scheduler, going on by itself after a stop (a requeue) or a kill (a restart in the
    allocation, or a requeue)."""

    def __init__(self, launcher_name: str) -> None:
        from hpc.launching.launchers import queued_launcher

        self.scheduler = queued_launcher(launcher_name)
        self.run_dirs: list[Path] = []

    def start(self, overrides: Sequence[str], script_args: list[str] | None, run_dir: Path) -> Launch:
        self.run_dirs.append(run_dir)
        return Launch(launch_command([*overrides, "wait=true"], script_args, run_dir), run_dir.with_suffix(".log"), timeout_s=None)

    @staticmethod
    def job_id(run_dir: Path) -> str | None:
        """The job id launch.py recorded at submission; None before it did."""
        try:
            found = json.loads(RunDir(run_dir).job.read_text()).get("job_id")
        except (OSError, ValueError, AttributeError):
            return None
        return found if isinstance(found, str) and found else None

    def signal(self, run_dir: Path, name: str) -> bool:
        job_id = self.job_id(run_dir)
        if job_id is None or self.scheduler.jobs([job_id])[job_id].state not in self.scheduler.running_states:
            return False
        return self.scheduler.signal(job_id, signal_name(run_dir, name)) is None

    def went_on(self, run_dir: Path, launch: Launch, after: str, seen: int) -> tuple[Launch, int] | None:
        if not wait_until(lambda: seen_events(run_dir, after) > seen, launch, QUEUE_POLL_S):
            code = launch.wait()
            if code == 0:
                return None
            raise VerifyFailure(f"the job ended ({launch.tail()}) after the {after} instead of going on; its run dir: {run_dir}")
        if after == "stop":
            resumed = int(str(events(run_dir, "stop")[-1].get("step") or 0))
            print(f"verify: job {self.job_id(run_dir)} stopped at step {resumed} and was requeued; it resumes once the scheduler starts it again", flush=True)
        else:
            resumed = int(str(events(run_dir, "start")[-1].get("resumed_from") or 0))
        return launch, resumed

    def abandon(self) -> None:
        for run_dir in self.run_dirs:
            job_id = self.job_id(run_dir)
            if job_id is not None:
                self.scheduler.cancel(job_id)
        Launch.stop_all(grace_s=10.0)


def runs_for(queued_on: str | None) -> Runs:
    """The runs of a job whose ranks run here (None), or through the scheduler behind launcher `queued_on`."""
    return QueuedRuns(queued_on) if queued_on is not None else LocalRuns()
