"""A command sbatch refuses leaves nothing behind: no run dir, no half-made sweep, no date folder.

No job is ever queued here, so this uses `require` rather than the needs_slurm fixture (whose
clean-up cancels every job that appeared meanwhile, other tests' included)."""

from __future__ import annotations

import pytest

from tests.conftest import require, slurm_is_up
from tests.support.runs import run_launch

pytestmark = pytest.mark.slurm


@pytest.mark.parametrize("sweep", [[], ["-m", "optim.lr=0.1,0.2"]], ids=["job", "sweep"])
def test_a_job_sbatch_refuses_leaves_no_folder(tmp_path, sweep):
    require(slurm_is_up(), "a running Slurm cluster (scripts/slurm-sim.sh start)")
    done = run_launch(*sweep, "cluster=simulated", "cluster.partition=no_such_partition", cwd=tmp_path, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "sbatch refused the job" in lines[0], done.stderr
    assert not (tmp_path / "runs").exists(), sorted(str(p) for p in (tmp_path / "runs").rglob("*"))
