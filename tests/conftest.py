"""Shared test helpers. Under CI=true a missing MPI or Slurm is a failure, never a skip."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.slurm import TERMINAL_STATES, job_state

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, what: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI (scripts/test.sh installs and starts it)")
    pytest.skip(f"{what} not available")


def slurm_is_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-p", "debug", "-N", "-o", "%T"], capture_output=True, text=True)
    return out.returncode == 0 and any(state in out.stdout for state in ("idle", "mixed", "allocated"))


@pytest.fixture
def needs_mpi() -> None:
    from hpc.spec import find_mpirun

    require(find_mpirun() is not None, "mpirun")


@pytest.fixture
def needs_slurm() -> None:
    require(slurm_is_up(), "a running Slurm cluster (scripts/slurm-sim.sh start)")


def run_launch(*overrides: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python launch.py OVERRIDES...` in a subprocess, run dirs under cwd."""
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={cwd / 'runs'}"],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
    )


def submit_job(*overrides: str, cwd: Path) -> tuple[str, Path]:
    """Submit one job through launch.py: its Slurm job id and its run dir."""
    submitted = run_launch(*overrides, cwd=cwd)
    assert submitted.returncode == 0, submitted.stderr
    found = re.search(r"submitted job (\d+)", submitted.stdout)
    assert found, submitted.stdout
    (run_dir,) = run_dirs(cwd)
    return found.group(1), run_dir


def end_process(pid: int) -> None:
    """SIGCONT (it may be stopped) then SIGKILL; gone already is fine."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in (root / "runs").glob("*/*/config.yaml"))


def wait_until_done(job_id: str, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in TERMINAL_STATES:
            return state
        time.sleep(0.5)  # polling squeue: Slurm offers no completion event to wait on
    pytest.fail(f"job {job_id} still {job_state(job_id)} after {timeout_s} s")
