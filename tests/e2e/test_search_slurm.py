"""A real Optuna study on the simulated Slurm: each batch one job array, a trial preempted and
requeued while its launcher is gone (killed, as when an ssh session dies), and the same command
again waits for the trials already submitted instead of submitting them twice; the study's best
beats the default lr, run beside it in the same configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.simcluster import poll, release_when_requeued
from hpc.slurm.slurmctl import job_state
from tests.conftest import wait_until_done
from tests.support.runs import ROOT, logged_steps, submit_job
from tests.support.search import check_study, launch_command, run_search, sweep_points

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

# One rank per trial (see tests/mpi/test_search_local.py)
TRIAL = (
    "cluster=simulated",
    "resources.tasks_per_node=1",
    "model.hidden_sizes=[512,512]",
    "trainer.epochs=3",
    "checkpoint.every_steps=5",
    "checkpoint.every_minutes=null",
)


def test_a_study_on_slurm_outlives_its_launcher_and_a_preempted_trial_and_beats_the_default(tmp_path):
    (tmp_path / "default").mkdir()
    default_job, default_run = submit_job(*TRIAL, cwd=tmp_path / "default")  # the default lr, alongside the study
    sweep_dir = tmp_path / "study"
    first = subprocess.Popen(launch_command(*TRIAL, sweep_dir=sweep_dir), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    poll(lambda: len(sweep_points(sweep_dir)) == 2 or first.poll() is not None, "the first batch to be submitted", timeout_s=120)
    assert first.poll() is None, first.communicate()[1]
    first.kill()  # the login session dies: no handler runs
    first.communicate()
    job_id = sweep_points(sweep_dir)[0]["job_id"]
    poll(lambda: logged_steps(sweep_dir / "0") >= 10, f"trial #0 ({job_id}) to train", timeout_s=240)
    assert subprocess.run(["scontrol", "requeue", job_id], capture_output=True).returncode == 0  # preempted: checkpoint, requeue
    release_when_requeued(job_id, 0)

    again = run_search(*TRIAL, sweep_dir=sweep_dir)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "waiting for the 2 trial(s) the previous launcher submitted" in again.stdout
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert [a["points"] for a in record["arrays"]] == [[0, 1], [2, 3]]  # each batch one array, submitted once
    result = json.loads((sweep_dir / "0" / "result.json").read_text())
    assert result["restarts"] >= 1 and result["resumed_from"] is not None and job_state(job_id) in ("COMPLETED", "UNKNOWN")
    values = check_study(sweep_dir, trials=4)
    assert wait_until_done(default_job) == "COMPLETED"
    assert max(values.values()) > json.loads((default_run / "result.json").read_text())["val_metrics"]["accuracy"]
    assert (sweep_dir / "optimization_results.yaml").exists()

    status = subprocess.run([sys.executable, "-m", "hpc.status", str(sweep_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "4 trials (4 completed, 0 failed" in status.stdout, status.stdout
