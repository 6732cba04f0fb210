"""Fixtures. Under CI=true a missing MPI or Slurm is a failure, never a skip; a Slurm test's
leftover jobs are cancelled so that they cannot hold nodes the next test needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from hpc.slurm import TERMINAL_STATES, job_state

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


def queued_job_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True)
    return set(out.stdout.split()) if out.returncode == 0 else set()


@pytest.fixture
def needs_mpi() -> None:
    from hpc.spec import find_mpirun

    require(find_mpirun() is not None, "mpirun")


@pytest.fixture
def needs_slurm():
    """A running Slurm; every job the test leaves queued or running is cancelled after it."""
    require(slurm_is_up(), "a running Slurm cluster (scripts/slurm-sim.sh start)")
    before = queued_job_ids()
    yield
    leftover = sorted(queued_job_ids() - before)
    if not leftover:
        return
    subprocess.run(["scancel", *leftover], capture_output=True)
    deadline = time.monotonic() + 60
    while queued_job_ids() & set(leftover) and time.monotonic() < deadline:
        time.sleep(0.2)  # squeue offers no event for a job leaving the queue


def wait_until_done(job_id: str, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in TERMINAL_STATES:
            return state
        time.sleep(0.5)  # polling squeue: Slurm offers no completion event to wait on
    pytest.fail(f"job {job_id} still {job_state(job_id)} after {timeout_s} s")
