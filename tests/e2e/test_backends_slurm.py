"""Other backends on the simulated Slurm: gloo's rendezvous comes from the job (first node, job
id); Horovod starts under srun --mpi=pmix."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import require
from tests.support.runs import run_dirs, run_launch

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


@pytest.mark.parametrize("backend", ["gloo", "horovod"])
def test_backend_trains_on_two_nodes_under_srun(tmp_path, backend):
    if backend == "horovod":
        require(importlib.util.find_spec("horovod") is not None, "Horovod (scripts/build-horovod.sh)")
    done = run_launch("cluster=simulated", f"comm={backend}", "resources.nodes=2", "trainer.epochs=2", "wait=true", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["world_size"], result["num_nodes"]) == ("completed", 4, 2)
    assert result["test_accuracy"] > 0.5
