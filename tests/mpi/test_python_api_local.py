"""`from hpc import submit` with local ranks, in the calling process: the job comes back at once
with its ranks running in the background, rank 0's console readable as it grows, and `cancel()`
stops the ranks at a step with a committed checkpoint that `command.txt` resumes; the calling
process keeps its umask, working directory and environment."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from hpc import Job, submit
from tests.support.runs import run_dirs, stopped_pattern
from trainers.checkpoint.layout import committed_steps

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def test_a_local_job_returns_at_once_and_its_console_streams_until_it_completes(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    here, environ = os.getcwd(), dict(os.environ)
    job = submit("trainer.epochs=2", "run_access=private", "+hydra.job.env_set.HPCTK_API_PROBE=1", cwd=tmp_path)
    assert isinstance(job, Job) and job.job_id is None and job.process is not None
    assert (os.getcwd(), dict(os.environ)) == (here, environ) and os.umask(umask) == umask  # as it was, while the ranks run
    assert job.state() == "RUNNING" and not (job.run_dir / "result.json").exists()  # back at once: the ranks' imports alone take seconds
    lines = list(job.lines(poll_s=0.1))
    assert any("epoch 1/2" in line for line in lines) and any("epoch 2/2" in line for line in lines), lines[-5:]
    assert job.wait(timeout_s=120) == "COMPLETED" and job.result()["status"] == "completed"
    assert job.logs().split("\n") == lines  # the whole console, read again
    (run_dir,) = run_dirs(tmp_path)
    assert job.run_dir == run_dir and oct(run_dir.stat().st_mode & 0o077) == "0o0"  # run_access=private
    assert json.loads((run_dir / "job.json").read_text())["pid"] == job.process.pid  # hpc.status asks this process
    launch_log = (run_dir / "launch.log").read_text()
    assert "ranks started in the background" in launch_log and "the ranks exited with code 0" in launch_log


def test_cancel_stops_the_ranks_at_a_step_with_a_checkpoint_and_command_txt_resumes(tmp_path):
    job = submit("trainer.epochs=40", "checkpoint.every_minutes=null", cwd=tmp_path)
    assert isinstance(job, Job)
    for line in job.lines(poll_s=0.1):
        if "epoch 1/40" in line:
            job.cancel()
            break
    assert job.wait(timeout_s=120) == "STOPPED"
    stopped_at = job.result()["steps"]
    assert committed_steps(job.run_dir / "checkpoints")[-1] == stopped_at > 0
    assert re.search(stopped_pattern("SIGTERM", stopped_at), job.logs()), job.logs()[-2000:]
    resumed = subprocess.run(["bash", str(job.run_dir / "command.txt")], capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert job.state() == "COMPLETED" and job.result()["resumed_from"] == stopped_at
