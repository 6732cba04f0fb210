"""Other backends on the simulated Slurm: gloo's rendezvous comes from the job (first node, job
id); Horovod starts under srun --mpi=pmix. Each run is checked to have used the backend asked
for, from what that library itself writes on the ranks' stderr, not only from the config."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from hpc.env import PORT_BASE, PORT_SPAN
from tests.conftest import require
from tests.support.runs import run_dirs, run_launch

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

# torch.distributed's c10d store client, with its log level raised through cluster.env, says on
# every rank that it connected to the job's rendezvous port (PORT_BASE + job id x 7): gloo ran
# (nothing torch prints names Gloo itself; no GPU here rules out NCCL, refused up front), and
# Horovod, which never uses c10d, did not fall back to it. Horovod itself prints nothing at the
# default log level, and with HOROVOD_LOG_LEVEL=info rank 0 once died of SIGSEGV at start-up
# here: its evidence is the rank log's `comm horovod` line and the absence of c10d.
TORCH_LOG = "+cluster.env.TORCH_CPP_LOG_LEVEL=INFO"


def c10d_connected(job_id: str) -> re.Pattern[str]:
    """The job's rendezvous port (hpc.env.rendezvous) for the ranks' step: its id follows the
    warm steps' (hpc.rank.warm, one per node)."""
    ports = "|".join(str(PORT_BASE + (int(job_id) * 7 + step * 3) % PORT_SPAN) for step in range(4))
    return re.compile(rf"\[c10d\] The client socket has connected to \S+:(?:{ports}) ")


def rank_stderr(run_dir: Path, rank: int) -> str:
    """submitit's per-task stderr of every start of the job (one folder per job id)."""
    return "".join(path.read_text() for path in sorted((run_dir / "slurm").glob(f"*/*_{rank}_log.err")))


EVIDENCE = {"gloo": "collectives: torch.distributed gloo (DistributedDataParallel)", "horovod": "collectives: horovod 0.28.1 over MPI"}


@pytest.mark.parametrize("backend", ["gloo", "horovod"])
def test_backend_trains_on_two_nodes_under_srun(tmp_path, backend):
    if backend == "horovod":
        require(importlib.util.find_spec("horovod") is not None, "Horovod (scripts/build-horovod.sh)")
    done = run_launch("cluster=simulated", f"comm={backend}", "resources.nodes=2", "trainer.epochs=2", "wait=true", TORCH_LOG, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["world_size"], result["num_nodes"]) == ("completed", 4, 2)
    assert result["val_metrics"]["accuracy"] > 0.5
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    for rank in range(4):
        stderr = rank_stderr(run_dir, rank)
        assert bool(c10d_connected(job_id).search(stderr)) == (backend == "gloo"), f"rank {rank}, {backend}: {stderr[-1500:]}"
        log = (run_dir / "logs" / f"rank-{rank:05d}.log").read_text()
        assert f"comm {backend} (" in log
        # What the library itself reports it started (collectives.describe), not the config.
        assert EVIDENCE[backend] in log, log[-1500:]
