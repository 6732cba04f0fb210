"""A full disk under a job of the real (simulated) Slurm: a small tmpfs mounted where every node
sees it (scripts/slurm-sim.sh's shared mounts), filled by rank 1 mid-run as a neighbour's job
would. The job ends FAILED without a restart in its allocation and without a requeue (the disk
stays full until someone acts), hpc.status says why from the end rank 0 recorded on that disk,
and once space is freed the command the line names (`python -m hpc.resubmit RUN`) resumes the
run from its newest committed checkpoint to the end, as a new job."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.simcluster import job_story, restarts
from hpc.rundir import RunDir
from tests.conftest import require, wait_until_done
from tests.support.runs import ROOT, fixtures_env, submit_job

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

SHARED_MOUNTS = Path(os.environ.get("HPCTK_SLURM_STATE", "/var/tmp/hpctk-slurm")) / "mounts"
JOB = (
    "cluster=simulated",
    "resources.nodes=2",
    "resources.tasks_per_node=1",
    *("task._target_=mytasks.filling.Filling", "+task.hidden=64", "+task.samples=1024", "+task.at_step=13", "+task.how=fill", "trainer.epochs=2"),
    *("checkpoint.every_steps=5", "checkpoint.async_save=false", "checkpoint.every_minutes=null"),  # step 10 committed before step 13
    # Room for both a restart inside the allocation and a requeue: a full disk must take neither
    *("cluster.failure_requeues=2", "cluster.allocation_restarts=1"),
)


@pytest.fixture
def shared_small_disk(tmp_path):
    shared = subprocess.run(["findmnt", "-n", "-o", "PROPAGATION", str(SHARED_MOUNTS)], capture_output=True, text=True).stdout.strip()
    require(shared == "shared", f"{SHARED_MOUNTS} shared with the simulated nodes (scripts/slurm-sim.sh start)")
    disk = SHARED_MOUNTS / f"disk-{tmp_path.name}-{os.getpid()}"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    disk.rmdir()


def test_a_full_disk_ends_the_job_without_restart_or_requeue_and_its_command_resumes_it(shared_small_disk, tmp_path):
    disk = shared_small_disk
    job_id, run_dir = submit_job(*JOB, f"+task.disk={disk}", f"+task.once={tmp_path / 'happened'}", cwd=disk, env=fixtures_env())
    assert wait_until_done(job_id) == "FAILED"
    assert restarts(job_id) == 0  # not requeued
    ended = RunDir(run_dir).read_result()  # end.json: the disk took no new file
    assert ended["reason"] == "disk full", ended
    line = ended["error"]
    assert re.match(
        rf"no space left on {re.escape(str(disk))} \(.+\) writing .+: the run stopped at step \d+; its newest committed checkpoint is step 10; ", line
    ), line
    assert line.endswith(f"free space, then python -m hpc.resubmit {run_dir}"), line
    logs = (run_dir / "logs" / "rank-00000.log").read_text()
    assert "restart 1" not in logs, logs[-2000:]  # no restart inside the allocation either
    shown = subprocess.run([sys.executable, "-m", "hpc.status", str(run_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert re.search(r"\bFAILED\b", shown.stdout) and "disk full" in shown.stdout, shown.stdout + shown.stderr

    (disk / "neighbour.bin").unlink()
    python, *command = shlex.split(line.rsplit("then ", 1)[1])
    assert python == "python"
    submitted = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    again = re.search(r"submitted job (\d+)", submitted.stdout).group(1)  # job.json names it: hpc.status follows it
    assert wait_until_done(again) == "COMPLETED", job_story(again)
    result = RunDir(run_dir).read_result()
    assert result["status"] == "completed" and result["resumed_from"] == 10, result
    shown = subprocess.run([sys.executable, "-m", "hpc.status", str(run_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "COMPLETED" in shown.stdout and again in shown.stdout, shown.stdout
