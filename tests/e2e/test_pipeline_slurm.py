"""A pipeline on the simulated Slurm: a training job, then an export job that `after=` holds until
the training completed (sbatch --dependency=afterok), run as a script job (`script=trainers.export`)
on the training's run dir. The second job waits (Reason=Dependency) while the first has not ended,
starts only after it, and exports the first one's final checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks.simcluster import parse_job_id
from hpc.slurmctl import job_fields
from tests.conftest import wait_until_done
from tests.support.runs import ROOT, run_launch
from trainers.export import load

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def test_a_job_after_another_waits_for_it_and_exports_what_it_trained(tmp_path):
    for where in ("train", "export"):
        (tmp_path / where).mkdir()
    train = run_launch("cluster=simulated", "resources.tasks_per_node=2", "trainer.max_steps=4", "hold=true", cwd=tmp_path / "train", timeout=120)
    assert train.returncode == 0, train.stderr
    trained = parse_job_id(train.stdout)
    assert f"(a job to run once it completes: after={trained})" in train.stdout  # the form the next command takes
    run_dir = re.search(r"run directory: (\S+)", train.stdout).group(1)
    model = tmp_path / "model.safetensors"
    after = f"after={trained}"
    job = ["cluster=simulated", "resources.tasks_per_node=1", "name=export", "script=trainers.export", after, f"run_root={tmp_path / 'export'}"]
    command = [sys.executable, str(ROOT / "launch.py"), *job, "--", run_dir, "--out", str(model)]  # the script's own arguments last
    export = subprocess.run(command, cwd=tmp_path / "export", capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    exporting = parse_job_id(export.stdout)
    try:
        fields = job_fields(exporting)
        assert (fields["JobState"], fields["Reason"], fields["Dependency"]) == ("PENDING", "Dependency", f"afterok:{trained}(unfulfilled)"), fields
        subprocess.run(["scontrol", "release", trained], check=True)
        assert wait_until_done(trained) == "COMPLETED"
        assert wait_until_done(exporting) == "COMPLETED"
    finally:
        subprocess.run(["scancel", trained, exporting], check=False)
    assert job_fields(exporting)["StartTime"] >= job_fields(trained)["EndTime"]  # ISO times: in order as text
    tensors, metadata = load(model)
    assert metadata["hpctk_step"] == "4" and tensors
