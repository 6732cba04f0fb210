"""A pipeline on the simulated Slurm, as docs/running-jobs.md shows it: a training job, an
evaluation of its checkpoint (`script=hpc.evaluate`) that `after=` holds until the training
completed (sbatch --dependency=afterok), and an export (`script=trainers.checkpoint.export`) held until the
evaluation completed. Each waits (Reason=Dependency) while the one before has not ended, starts
only after it, and works on the training's final checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from benchmarks.simcluster import parse_job_id
from hpc.slurm.slurmctl import job_fields
from tests.conftest import wait_until_done
from tests.support.runs import ROOT, run_launch
from trainers.checkpoint.export import load

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def test_a_chain_of_train_evaluate_export_runs_in_order_each_job_held_until_the_one_before_completed(tmp_path):
    for where in ("train", "evaluate", "export"):
        (tmp_path / where).mkdir()
    train = run_launch("cluster=simulated", "resources.tasks_per_node=2", "trainer.max_steps=4", "hold=true", cwd=tmp_path / "train", timeout=120)
    assert train.returncode == 0, train.stderr
    trained = parse_job_id(train.stdout)
    assert f"(a job to run once it completes: after={trained})" in train.stdout  # the form the next command takes
    run_dir = re.search(r"run directory: (\S+)", train.stdout).group(1)
    model, figures = tmp_path / "model.safetensors", tmp_path / "eval.json"

    def after(job_id: str, name: str, script: str, *args: str) -> str:
        job = ["cluster=simulated", "resources.tasks_per_node=1", f"name={name}", f"script={script}", f"after={job_id}", f"run_root={tmp_path / name}"]
        command = [sys.executable, str(ROOT / "launch.py"), *job, "--", run_dir, *args]  # the script's own arguments last
        submitted = subprocess.run(command, cwd=tmp_path / name, capture_output=True, text=True, timeout=120)
        assert submitted.returncode == 0, submitted.stderr
        return parse_job_id(submitted.stdout)

    evaluating = after(trained, "evaluate", "hpc.evaluate", "--split", "val", "--out", str(figures))
    exporting = after(evaluating, "export", "trainers.export", "--out", str(model))
    try:
        for job_id, waits_for in ((evaluating, trained), (exporting, evaluating)):
            fields = job_fields(job_id)
            assert (fields["JobState"], fields["Reason"], fields["Dependency"]) == ("PENDING", "Dependency", f"afterok:{waits_for}(unfulfilled)"), fields
        subprocess.run(["scontrol", "release", trained], check=True)
        for job_id in (trained, evaluating, exporting):
            assert wait_until_done(job_id) == "COMPLETED", job_id
    finally:
        subprocess.run(["scancel", trained, evaluating, exporting], check=False)
    for earlier, later in ((trained, evaluating), (evaluating, exporting)):
        assert job_fields(later)["StartTime"] >= job_fields(earlier)["EndTime"]  # ISO times: in order as text
    evaluated = json.loads(figures.read_text())
    assert (evaluated["step"], evaluated["split"]) == (4, "val") and evaluated["samples"] > 0 and 0.0 <= evaluated["metrics"]["accuracy"] <= 1.0
    tensors, metadata = load(model)
    assert metadata["hpctk_step"] == "4" and tensors
