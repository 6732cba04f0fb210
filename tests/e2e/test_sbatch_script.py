"""sbatch/train.sbatch typed by hand on the real (simulated) Slurm: same rank entry point."""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path

import pytest

from hpc.tools.status import statuses
from tests.conftest import wait_until_done
from tests.support.runs import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def sbatch_wait(tmp_path, *args) -> str:
    """Submit with plain sbatch, poll until the job ends; returns its final state."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return wait_until_done(submitted.stdout.strip().split(";")[0])


def test_plain_sbatch_trains_on_two_nodes_with_overrides(tmp_path):
    state = sbatch_wait(
        tmp_path,
        "--nodes=2",
        "--ntasks-per-node=2",
        str(ROOT / "sbatch" / "train.sbatch"),
        "cluster=simulated",
        "trainer.epochs=4",
        f"run_root={tmp_path / 'runs'}",
    )
    (output,) = tmp_path.glob("slurm-*.out")
    assert state == "COMPLETED", output.read_text()
    run_dir = re.search(r"run directory: (\S+)", output.read_text()).group(1)
    assert run_dir.endswith(f"/jobs/{output.name.split('-')[1].split('.')[0]}_train")
    summary = json.loads((tmp_path / "runs" / run_dir / "result.json").read_text())
    assert (summary["world_size"], summary["num_nodes"], summary["epochs"]) == (4, 2, 4)
    # As a launcher's run (issue 45): private, known to hpc.status by its job id, its code frozen
    run = Path(run_dir)
    job_id = output.name.split("-")[1].split(".")[0]
    assert stat.S_IMODE(run.stat().st_mode) == 0o700 and stat.S_IMODE((run / "config.yaml").stat().st_mode) == 0o600
    assert stat.S_IMODE((run / "logs" / "rank-00000.log").stat().st_mode) == 0o600  # the ranks' files too: the umask reached them
    assert json.loads((run / "job.json").read_text())["job_id"] == job_id
    assert f"code: {run / 'code'}" in (run / "logs" / "rank-00000.log").read_text()
    (status,) = statuses(run)
    assert (status.job_id, status.state) == (job_id, "COMPLETED")


def test_override_contradicting_the_allocation_is_refused(tmp_path):
    state = sbatch_wait(
        tmp_path,
        "--nodes=1",
        "--ntasks-per-node=2",
        str(ROOT / "sbatch" / "train.sbatch"),
        "cluster=simulated",
        "resources.nodes=3",
        f"run_root={tmp_path / 'runs'}",
    )
    (output,) = tmp_path.glob("slurm-*.out")
    assert state == "FAILED"
    assert "error: resources.nodes=3 but sbatch granted 1" in output.read_text()
    assert not (tmp_path / "runs").exists()


def test_plain_sbatch_job_resumes_in_the_same_run_dir_after_a_signal(tmp_path):
    from benchmarks.simcluster import poll, release_when_requeued
    from tests.support.runs import logged_steps

    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--ntasks-per-node=1",  # two ranks on two nodes as above would only cost start-up time
            f"--output={tmp_path}/slurm-%j.out",
            str(ROOT / "sbatch" / "train.sbatch"),
            "cluster=simulated",
            "model.hidden_sizes=[512,512]",
            "trainer.epochs=2",
            "checkpoint.every_steps=5",
            f"run_root={tmp_path / 'runs'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job_id = submitted.stdout.strip()
    run_dir = tmp_path / "runs" / "jobs" / f"{job_id}_train"
    poll(lambda: logged_steps(run_dir) >= 8, "step 8")
    subprocess.run(["scancel", "--signal=USR1", "--full", job_id], check=True)  # --full: the batch shell gets it too
    release_when_requeued(job_id, 0)
    assert wait_until_done(job_id) == "COMPLETED"
    summary = json.loads((run_dir / "result.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == 1 and summary["resumed_from"] >= 8
    assert [p.name for p in (tmp_path / "runs" / "jobs").iterdir()] == [run_dir.name]
