"""The batch script's requeue against a slurmctld that does not answer in time (a busy or
restarting controller on a real cluster): `scontrol requeue` gives up after MessageTimeout, yet
its request waits at the controller and goes through once it answers. The EXIT trap's
hpctk_requeue tries again and sees the restart counted, instead of leaving the run stopped (or
saying it was not requeued when it was). Retries against a controller that keeps refusing:
tests/unit/test_requeue.py."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from benchmarks.simcluster import poll, release_when_requeued, restarts
from hpc.slurm.batch import requeue_function_lines
from hpc.slurm.slurmctl import job_state

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def slurmctld_pid() -> int:
    found = subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True, text=True).stdout.split()
    assert len(found) == 1, f"one slurmctld expected, found {found}"
    return int(found[0])


def test_a_requeue_that_times_out_at_a_silent_slurmctld_is_seen_through_and_not_repeated(tmp_path):
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "-N", "1", "-o", "/dev/null", "--wrap", "sleep 300"], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.strip()
    poll(lambda: job_state(job_id) == "RUNNING", f"job {job_id} to run")
    trap = tmp_path / "requeue.sh"
    trap.write_text("\n".join([*requeue_function_lines(), 'hpctk_requeue "$1"', "echo requeued"]) + "\n")
    errors = tmp_path / "stderr"
    controller = slurmctld_pid()
    os.kill(controller, signal.SIGSTOP)  # silent: every RPC waits, until MessageTimeout (10 s here)
    try:
        with errors.open("w") as sink:
            env = {**os.environ, "SLURM_RESTART_COUNT": "0"}
            requeue = subprocess.Popen(["bash", str(trap), job_id], stdout=subprocess.PIPE, stderr=sink, text=True, env=env)
        poll(lambda: "failed (try 1 of" in errors.read_text() or requeue.poll() is not None, "the first try to time out", timeout_s=60)
    finally:
        os.kill(controller, signal.SIGCONT)
    out, _ = requeue.communicate(timeout=120)
    told = Path(errors).read_text()
    assert requeue.returncode == 0 and out == "requeued\n", told
    assert "failed (try 1 of 5)" in told and "not requeued" not in told, told  # the try timed out, and went through
    assert restarts(job_id) == 1  # once: the try that timed out, not a second requeue on top
    subprocess.run(["scancel", job_id], check=False)


def stop_daemon(name: str) -> None:
    subprocess.run(["pkill", "-TERM", "-x", name], check=False)
    poll(lambda: subprocess.run(["pgrep", "-x", name], capture_output=True).returncode != 0, f"{name} to exit")


def test_a_requeue_due_while_munge_is_down_or_slurmctld_restarts_goes_through_once_it_is_back(tmp_path):
    """The trap's requeue meets munge stopped (scontrol cannot authenticate), then, in the job's
    next start, a slurmctld that was stopped and started again (its state saved and recovered: the
    job runs on through the restart). Each try that fails is one line; the try after the daemon is
    back goes through, once: Restarts counts one per requeue."""
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "-N", "1", "-o", "/dev/null", "--wrap", "sleep 300"], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.strip()
    trap = tmp_path / "requeue.sh"
    trap.write_text("\n".join([*requeue_function_lines(), 'hpctk_requeue "$1"', "echo requeued"]) + "\n")
    daemons = {"munged": ["runuser", "-u", "munge", "--", "munged"], "slurmctld": ["slurmctld"]}
    try:
        for start, (daemon, command) in enumerate(daemons.items()):
            poll(lambda: job_state(job_id) == "RUNNING", f"job {job_id} to run")
            stop_daemon(daemon)
            errors = tmp_path / f"stderr-{daemon}"
            with errors.open("w") as sink:
                requeue = subprocess.Popen(
                    ["bash", str(trap), job_id], stdout=subprocess.PIPE, stderr=sink, text=True, env={**os.environ, "SLURM_RESTART_COUNT": str(start)}
                )
            poll(lambda: "failed (try 1 of" in errors.read_text() or requeue.poll() is not None, f"the first try to fail without {daemon}", timeout_s=60)
            subprocess.run(command, check=True)
            out, _ = requeue.communicate(timeout=120)
            told = errors.read_text()
            assert requeue.returncode == 0 and out == "requeued\n", told
            assert "failed (try 1 of 5)" in told and "not requeued" not in told, told
            if start + 1 < len(daemons):  # the next phase needs it running: Slurm's requeue hold lifted
                release_when_requeued(job_id, start)
            poll(lambda: restarts(job_id) == start + 1, f"job {job_id}'s requeue {start + 1} to count")
    finally:
        for daemon, command in daemons.items():  # back, whatever failed
            if subprocess.run(["pgrep", "-x", daemon], capture_output=True).returncode != 0:
                subprocess.run(command, check=False)
        subprocess.run(["scancel", job_id], check=False)
