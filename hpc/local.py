"""The embedded default: the job's ranks as local MPI processes under mpirun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

from hpc.config import JobConfig
from hpc.errors import UserError
from hpc.rundir import PROJECT_ROOT, RunDir
from hpc.spec import find_mpirun


def mpirun_command(mpirun: str, job: JobConfig, run_dir: RunDir) -> list[str]:
    ranks = job.resources.nodes * job.resources.tasks_per_node
    return [
        mpirun,
        "-n", str(ranks),
        "--map-by", ":OVERSUBSCRIBE",  # more ranks than cores is fine for a laptop run
        "--bind-to", "none",  # let the OS spread ranks; binding is the topology issue's job
        *job.cluster.mpirun_args,
        sys.executable, "-m", "hpc.rank_main", str(run_dir.path),
    ]


def run_local(job: JobConfig, env: dict[str, str], run_dir: RunDir, info: dict[str, Any] | None = None) -> int:
    """Run in the foreground; rank 0 prints progress. Returns mpirun's exit code. job.json
    names this process, so `python -m hpc.status` can tell a running run from a dead one."""
    mpirun = find_mpirun()
    if mpirun is None:
        raise UserError("mpirun not found: run scripts/install.sh")
    run_dir.write_json(run_dir.job, {"launcher": "local", "pid": os.getpid(), "host": socket.gethostname(), "run_dir": str(run_dir.path), **(info or {})})
    command = mpirun_command(mpirun, job, run_dir)
    (run_dir.path / "command.txt").write_text(" ".join(command) + "\n")
    pythonpath = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    # The torch.distributed rendezvous (comm=gloo/nccl): rank 0's store on a port free now.
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tty = {"HPCTK_TTY": "1" if sys.stdout.isatty() else "0"}  # rank 0 draws a progress bar in a terminal
    return subprocess.run(command, env={**os.environ, **rendezvous, **env, **tty, "PYTHONPATH": pythonpath}).returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
