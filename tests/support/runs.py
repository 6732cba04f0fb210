"""Start runs through launch.py and read what they leave in their run directories."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.rundirs import logged_steps, rank_pids, ranks_environment, resume_command, run_dirs, state_hash, step_losses
from benchmarks.simcluster import parse_job_id
from collectives.mpirun import mpirun_command

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["logged_steps", "rank_pids", "ranks_environment", "resume_command", "run_dirs", "state_hash", "step_losses"]  # re-exported for the tests


def fixtures_env() -> dict[str, str]:
    """This process's environment with the tests' user task package (tests/fixtures/mytasks) on
    PYTHONPATH: outside the toolkit's packages, as a user's own package would be."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "fixtures")}


def stopped_pattern(signal_name: str, steps: int) -> str:
    """The regex of rank 0's stop line. The launcher or Slurm signals the ranks ms apart: when
    another rank's signal ends the step, rank 0's own may land during the stop's save, and the
    line says so ("(received during the final save)")."""
    return rf"stopped by {signal_name}(?: \(received during [a-z ]+\))? at step {steps}, checkpoint committed"


def run_launch(*overrides: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python launch.py OVERRIDES...` in a subprocess, run dirs under cwd."""
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={cwd / 'runs'}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def mpirun(ranks: int, *command: str) -> subprocess.CompletedProcess[str]:
    """`mpirun -n RANKS python COMMAND...` from the repository root (oversubscribed, unbound)."""
    args = mpirun_command(ranks, [sys.executable, *command])
    return subprocess.run(args, capture_output=True, text=True, env=ranks_environment(), timeout=300, cwd=ROOT)


def start_launch(*overrides: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`python launch.py OVERRIDES...` in the background (run dirs under cwd), stderr kept."""
    command = [sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={cwd / 'runs'}"]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_run(launched: subprocess.Popen[str], cwd: Path, ready: Callable[[Path], bool], what: str, timeout_s: float = 120) -> Path:
    """Poll until the run dir of `launched` exists and `ready(run_dir)`; fails at once if the
    launch ended first (with its stderr), or after `timeout_s`. Returns the run dir."""
    deadline = time.monotonic() + timeout_s
    while not run_dirs(cwd) or not ready(run_dirs(cwd)[0]):
        assert launched.poll() is None, f"the run ended before {what}: {launched.stderr.read()[-2000:] if launched.stderr else ''}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)  # polling the run dir: there is no event to wait on
    (run_dir,) = run_dirs(cwd)
    return run_dir


def submit_job(*overrides: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[str, Path]:
    """Submit one job through launch.py: its Slurm job id and its run dir."""
    submitted = run_launch(*overrides, cwd=cwd, env=env)
    assert submitted.returncode == 0, submitted.stderr
    (run_dir,) = run_dirs(cwd)
    return parse_job_id(submitted.stdout), run_dir


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler installed for `sig` (SigCgt in /proc/PID/status)."""
    return sig in signal_sets(pid, "SigCgt")


def pending(pid: int, *sigs: signal.Signals) -> bool:
    """Whether one of `sigs` waits to be handled by process `pid` (sent to it or to one of its
    threads): a stopped process keeps what it was sent until SIGCONT."""
    return not signal_sets(pid, "ShdPnd", "SigPnd").isdisjoint(sigs)


def signal_sets(pid: int, *fields: str) -> set[int]:
    """The signals in the masks `fields` of /proc/PID/status (SigCgt, ShdPnd, ...); none once it ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return set()
    mask = 0
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            mask |= int(value.strip(), 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


def run_until_signalled(command: list[str], env: dict[str, str], run_dir: Path, after_steps: int, sig: signal.Signals) -> int:
    """Start the ranks, signal every rank once `after_steps` more steps are logged; exit code."""
    start = logged_steps(run_dir)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while logged_steps(run_dir) < start + after_steps:
        assert proc.poll() is None, f"job ended before the signal: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)  # polling the step log: there is no event to wait on
    for pid in rank_pids(run_dir):
        os.kill(pid, sig)  # Slurm signals every task, not mpirun
    return proc.wait(timeout=120)


HOLD = "import sys, time; from pathlib import Path; from hpc.runlock import {what}; {what}(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"


def holding(what: str, run_path: Path) -> subprocess.Popen[str]:
    """Another process that holds the run dir's lock `what` (hpc.runlock's hold_launch or
    hold_rank: a launcher, a rank) until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(what=what), str(run_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def digits_shards(directory: Path) -> str:
    """The built-in digits as numpy arrays, converted to small shards (several per split), with
    the validation images once more as a held-out test split; the shards' glob."""
    import h5py
    import numpy as np

    from trainers.data.convert import main as convert
    from trainers.data.datasets import build_digits_hdf5

    with h5py.File(build_digits_hdf5(directory / "digits.h5")) as f:
        for name in ("train/x", "train/y", "val/x", "val/y"):
            np.save(directory / (name.replace("/", "_") + ".npy"), f[name][:])
    flags = (("x", "train_x"), ("y", "train_y"), ("val-x", "val_x"), ("val-y", "val_y"), ("test-x", "val_x"), ("test-y", "val_y"))
    arrays = [f"--{flag}={directory / name}.npy" for flag, name in flags]
    assert convert(["numpy", *arrays, "--scale", str(1 / 16), "--shard-mb", "0.03", f"--out={directory / 'shards'}"]) == 0
    return str(directory / "shards" / "*.h5")
