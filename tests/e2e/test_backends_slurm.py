"""comm=gloo on the simulated Slurm: the rendezvous comes from the job (first node, job id)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_dirs, run_launch

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def test_gloo_trains_on_two_nodes_with_a_rendezvous_from_slurm(tmp_path):
    done = run_launch("cluster=simulated", "comm=gloo", "resources.nodes=2", "trainer.epochs=2", "wait=true", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["world_size"], result["num_nodes"]) == ("completed", 4, 2)
    assert result["test_accuracy"] > 0.5
