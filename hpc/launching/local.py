"""The embedded default: the job's ranks as local MPI processes under mpirun.

Like a Slurm job, a local run freezes its code into <run_dir>/code/ (hpc.launching.snapshot), and the
command it runs (kept in command.txt, to resume the run) pins that copy: `/usr/bin/env PYTHONPATH=<code>
PYTHONSAFEPATH=1 ... mpirun ...`. Pasted tomorrow from any directory, with any PYTHONPATH, it
resumes the code the run started with, not whatever checkout is importable there.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from collectives.mpirun import find_mpirun, mpirun_command, one_machine_environment
from hpc.config.schema import JobConfig
from hpc.env import TTY_VARIABLE
from hpc.errors import UserError
from hpc.launching.ranks import run_in_session
from hpc.launching.snapshot import freeze_job_code
from hpc.rundir import RunDir


def rank_command(job: JobConfig, run_dir: RunDir, mpirun: str | None = None) -> list[str]:
    """The job's ranks on this machine: hpc.launching.ranks (signals, the run's exit code) running
    mpirun, which starts the rank entry point on the run dir."""
    ranks = job.resources.nodes * job.resources.tasks_per_node
    command = mpirun_command(ranks, [sys.executable, "-m", "hpc.rank.main", str(run_dir.path)], job.cluster.mpirun_args, mpirun)
    warm = ["--warm"] if job.cluster.warm_ranks else []  # the ranks forked from one interpreter that imported torch
    return [sys.executable, "-m", "hpc.launching.ranks", *warm, str(run_dir.path), *command]


def pinned_command(command: list[str], env: dict[str, str], code: Path, inherited_pythonpath: str | None) -> list[str]:
    """`command` under `env` with `code` first on PYTHONPATH, as one pasteable command line.
    PYTHONSAFEPATH keeps `python -m` from importing a checkout in the working directory; the
    PYTHONPATH of launch time (a user's own packages) follows the frozen copy, never before it."""
    pythonpath = os.pathsep.join(filter(None, [str(code), inherited_pythonpath]))
    pinned = {**env, "PYTHONPATH": pythonpath, "PYTHONSAFEPATH": "1"}
    # /usr/bin/env by its path: a PATH without it (a venv's bin/ alone) must still run the job.
    return ["/usr/bin/env", *(f"{key}={value}" for key, value in sorted(pinned.items())), *command]


def run_local(
    job: JobConfig, env: dict[str, str], run_dir: RunDir, info: dict[str, Any] | None = None, code: Path | None = None, stops: list[int] | None = None
) -> int:
    """Run in the foreground; rank 0 prints progress. Returns mpirun's exit code. job.json
    names this process, so `python -m hpc.status` can tell a running run from a dead one.
    `code`: sources frozen already (a sweep's one copy); by default <run_dir>/code, made now.
    `stops`: each signal that reached this process while the ranks ran is appended (a sweep
    stops after a run that was asked to stop, even one that completed as the signal came)."""
    command = local_command(job, env, run_dir, code)
    write_job_record(run_dir, os.getpid(), info)
    # rank 0 draws a progress bar in a terminal, as wide as this one (mpirun's own pseudo-terminal
    # tells the ranks 0 columns)
    tty = {TTY_VARIABLE: str(terminal_width()) if sys.stdout.isatty() else "0"}
    return run_command(command, {**os.environ, **tty}, stops)  # the very command.txt


def start_local(job: JobConfig, env: dict[str, str], run_dir: RunDir, console: Path) -> subprocess.Popen[bytes]:
    """The ranks started in the background (the Python API), as run_local runs them: mpirun's
    output (rank 0's console) into `console`, in a session of their own (the caller's terminal
    signals do not reach them; SIGINT or SIGTERM to the process stops them at a step with a
    save, as a Ctrl-C does). job.json names the process."""
    command = local_command(job, env, run_dir, None)
    with console.open("ab") as out:
        env_here = {**os.environ, TTY_VARIABLE: "0"}  # no terminal: no progress bar
        proc = subprocess.Popen(command, env=env_here, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    write_job_record(run_dir, proc.pid, None)
    return proc


def local_command(job: JobConfig, env: dict[str, str], run_dir: RunDir, code: Path | None) -> list[str]:
    """command.txt's command, written there: the ranks under mpirun with the frozen code pinned."""
    mpirun = find_mpirun()
    if mpirun is None:
        raise UserError("mpirun not found: run scripts/install.sh")
    if code is None:
        code = run_dir.code if run_dir.code.is_dir() else freeze_job_code(run_dir.code, job)
    command = pinned_command(rank_command(job, run_dir, mpirun), {**env, **one_machine_environment(os.environ)}, code, os.environ.get("PYTHONPATH"))
    (run_dir.path / "command.txt").write_text(shlex.join(command) + "\n")
    return command


def write_job_record(run_dir: RunDir, pid: int, info: dict[str, Any] | None) -> None:
    """job.json: the process that runs the ranks, so `python -m hpc.status` can tell a running
    run from a dead one."""
    run_dir.write_json(run_dir.job, {"launcher": "local", "pid": pid, "host": socket.gethostname(), "run_dir": str(run_dir.path), **(info or {})})


def terminal_width() -> int:
    """This terminal's columns, from the terminal itself (a COLUMNS variable may be stale: some
    tools export one); 80 where it says 0 or cannot tell."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


def run_command(command: list[str], env: dict[str, str], stops: list[int] | None = None) -> int:
    """Run command.txt's command (hpc.launching.ranks) in the foreground, in a session of its own so
    that a terminal's Ctrl-C reaches it once, from here: each SIGINT, SIGTERM or SIGHUP that
    reaches this process is passed on (the first stops the ranks at a step, a second ends them)
    and appended to `stops`."""

    def forward(proc: subprocess.Popen[bytes], signum: int) -> None:
        if stops is not None:
            stops.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    return run_in_session(command, env, forward)
